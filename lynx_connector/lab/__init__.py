"""The lab: benchmarks (``bench``), the 1P1D launcher (``launch``), network namespaces (``netns``), the demo,
the real model and data helpers (``models``, ``data``), the timing client, the NIXL source peer process (``peer``)
and the docs generator (``docgen``).

Nothing here is imported by the connector at run time (connector, scheduler and worker halves, codec, transport,
speculative scheduler, plugin, proxy); only the ``lynx`` CLI's lab subcommands (bench, demo, prepare-model) import
it, lazily.
"""
