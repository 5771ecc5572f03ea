"""What a stage is and the front ends that make one: chains of pure functions and modules
(``chain``, ``module_chain``), functions cut at ``ef.cut`` marks (``function``), any model cut by
graph capture (``capture``), physical black boxes (``physical``) and FSDP2 modules (``fsdp``)."""

__all__: list[str] = []  # the modules are the API: nothing is re-exported here
