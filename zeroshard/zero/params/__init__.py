"""ZeRO's parameters: whole at stages 0-2 (``whole``: all-gathered after each step) or
gathered per module unit around their use at stage 3 (``gatherer``: when, from module
hooks placed by ``wiring``; ``units``: gathering and releasing under the live cap;
``schedule``: the recorded orders; ``states``: the named states and their transition
tables; the released-parameter guard in ``hooks``, leaf modules in ``leaves``, edits
made outside the engine in ``edits``), behind one Protocol (``manager``); and
DeepSpeed's ``zero.Init`` (``init``, ``init_ops``), ``GatheredParameters``
(``gathered``) and ``register_external_parameter`` (``external``).
"""
