"""Pipeline parallelism over the mesh's ``pp`` axis: ``PipelineModule`` and its
partitioning (``module``), splitting a model into stages (``split``), schedules as data
(``schedules``), one stage's run of a schedule (``exec``), the point-to-point transfers
(``p2p``), the pipeline engine (``engine``) and its schedule plots (``plot``).
"""
