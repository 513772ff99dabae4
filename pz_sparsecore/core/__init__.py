"""Stage 1, the model of the data: what every later stage reads.

* `specs`: tables, features, optimizer specs (frozen; upstream's fields).
* `optimizers`: the optimizer registry (slots, hyper-parameters, row
  update), the one place an optimizer's equations live in Python.
* `layout`: stacking and MOD sharding of tables (logical <-> physical).
* `plan`: every static size of the specs on a topology, computed once.
* `buffer_format`: the CSR-wrapped COO buffer format and its constants.
* `preprocessed`: the types that cross stages (`PreprocessedInput`,
  `SparseDenseMatmulInputStats`).
* `spec_proto`: specs to and from upstream's `EmbeddingSpecProto`.

Nothing here imports or names another stage (`host`, `device`, `nn`,
`viz`), not even inside a function: Treescope draws the specs, plans,
buffers and stats with the renderers `viz.treescope` registers for them.
"""
