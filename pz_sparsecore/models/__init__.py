"""Example models built on `SparseCoreEmbed`, and the demo around them.

The Shakespeare next-word model and its command line:

* `shakespeare`: the model (specs, `NextWordModel`, `build_model`, the loss,
  the held-out evaluation) and `run`, a training run with FDO refreshes;
* `shakespeare_config`: `RunConfig`, importable without JAX;
* `shakespeare_cli`: the `shakespeare` command of `python -m pz_sparsecore`;
* `shakespeare_report`: the HTML report a run writes with `--report DIR`.
"""
