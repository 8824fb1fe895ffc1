"""ZeRO's parameters: whole at stages 0-2 (``whole``: all-gathered after each step) or
gathered per module unit around their use at stage 3 (``gatherer``, with its guards in
``hooks``, leaf modules in ``leaves`` and edits made outside the engine in ``edits``),
and DeepSpeed's ``zero.Init`` (``init``, ``init_ops``), ``GatheredParameters``
(``gathered``) and ``register_external_parameter`` (``external``).
"""
