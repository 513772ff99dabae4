"""Stage 3, on the devices: buffers and tables in, activations and updated
tables out.

* `kernels`: the FFI handlers (C++, CUDA), their dispatch, the pure-JAX
  reference and the contract every call is checked against.
* `topology`: the mesh, the tables' shard axis, SparseCores per device.
* `routing`: lookup and fused update under `shard_map`, per stack through
  its exchange.
* `exchange`: how ids and values cross devices, one module per mode behind
  one interface (`exchange.base.Mode`), and the byte model that picks one.
* `minibatching`: the device half (one minibatch's buffers, the count the
  devices loop over).
* `guard`: reading, checking and undoing an update's rows (O(batch)).
* `input_check`: the buffers' contents checked against the plan and the
  exchange before the kernels see them.

Imports `core` only (and the compiled extension); never `host`, `nn` or
`viz`, and never numba.
"""
