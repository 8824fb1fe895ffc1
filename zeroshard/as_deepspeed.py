"""``import zeroshard.as_deepspeed``: Hugging Face's DeepSpeed integration runs on zeroshard.

Put it before any ``transformers`` / ``accelerate`` import (or launch with ``zeroshard
run --as-deepspeed``, which does it in every worker). Then ``TrainingArguments(deepspeed=
"ds_config.json")`` and ``Accelerator(deepspeed_plugin=...)`` train with zeroshard. It
refuses (raises) if a real DeepSpeed is installed. See
``zeroshard.compat.deepspeed_alias`` for how.
"""

from zeroshard.compat.deepspeed_alias import register

register()
