"""Fast mixed-adapter LoRA batches for HuggingFace transformers + PEFT.

model = enable_csgmv(peft_model)
out = model.generate(input_ids, attention_mask=mask, adapter_ids=["legal", None, "chat"], max_new_tokens=64)
disable_csgmv(model)
"""

from . import _compat  # noqa: F401  (first: raises ImportError below the dependency floors)
from .model import adapter_ids_scope, csgmv_stats, disable_csgmv, enable_csgmv, is_csgmv_enabled
from .plan import BatchPlan

__all__ = ["enable_csgmv", "disable_csgmv", "is_csgmv_enabled", "csgmv_stats", "adapter_ids_scope", "BatchPlan"]
__version__ = "0.1.0"
