"""Quick start: a tiny random-weight Llama, three LoRA adapters, one generate whose rows use different adapters."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_csgmv import enable_csgmv

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
)
lora = dict(target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # random B: adapters that change outputs
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, **lora), adapter_name="legal")
model.add_adapter("chat", LoraConfig(r=4, **lora))
model.add_adapter("code", LoraConfig(r=16, lora_alpha=32, **lora))
model.to(device).eval()
enable_csgmv(model)  # patches the PeftModel in place; disable_csgmv(model) undoes it

input_ids = torch.randint(1, 256, (1, 12), device=device).repeat(4, 1)  # one prompt, four rows
adapter_ids = ["legal", None, "chat", "code"]  # one entry per row; None (or "__base__") is the base model
out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), adapter_ids=adapter_ids, max_new_tokens=8)
for name, tokens in zip(adapter_ids, out[:, input_ids.shape[1] :].tolist()):
    print(f"{name or 'base'}: {tokens}")
