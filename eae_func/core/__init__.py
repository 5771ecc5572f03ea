"""The one reverse step and what every driver shares: the forward tape and the reverse fold over a
stage range (``tape``, ``fold``, ``runner``), boundaries and their records (``boundary``,
``costates``), the local vjp (``vjp``), RNG, mode and autocast replay (``replay``), ties, early
stop, remat, fused updates, options, and what an estimator sees (``problem``)."""

__all__: list[str] = []  # the modules are the API: nothing is re-exported here
