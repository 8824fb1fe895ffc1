"""The training runtime: the engine (``engine``), how it is assembled from the config
(``build``), the methods Hugging Face calls on it (``hf_methods``), the micro-batch size
read from the first batch (``first_batch``), the check that ranks agree
(``agreement``), dtypes and the loss scaler (``precision``), torch optimizers from the
config (``optim``) and DeepSpeed's learning-rate schedules (``schedulers``).
"""
