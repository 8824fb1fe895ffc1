"""The training runtime: the engine (``engine``), the parts it is composed of, built from
the config (``build``), the model prepared before ZeRO (``prepare``), what backward and
step do to the parts (``step``), the whole state dict Hugging Face saves
(``hf_methods``), ``engine.compile`` (``compiling``), the micro-batch size read from the
first batch (``first_batch``), the check that ranks agree (``agreement``), dtypes and the
loss scaler (``precision``), torch optimizers and the scheduler from the config
(``optim``) and DeepSpeed's learning-rate schedules (``schedulers``).
"""
