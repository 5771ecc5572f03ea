"""What drives the reverse step over a model: ``ef.sweep`` and friends on a chain (``sweep``,
``sweep_chain``) or a model (``sweep_model``), run-time cuts (``cuts``, ``model_sweep``) and the
switch that installs them for ``loss.backward()`` (``switch``)."""

__all__: list[str] = []  # the modules are the API: nothing is re-exported here
