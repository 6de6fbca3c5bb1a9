"""The harness that runs PEFT's own mixed-batch tests through csgmv (``benchmarks/peft_tests/run.py`` with
``benchmarks/peft_tests/plugin.py``): a call with ``adapter_names`` of a stock ``PeftModel`` must reach csgmv's
forward and generate, not PEFT's, or the peer run tests stock PEFT twice. Run in a subprocess: the plugin patches
PEFT's classes for the whole process."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys
import torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import plugin
from helpers import ALL_LINEAR, DEVICE, add_adapters, close, make_batch, per_adapter, stitch, tiny_model
from peft_csgmv import csgmv_stats, is_csgmv_enabled

plugin.BACKEND = "auto"
plugin.install_csgmv_wrappers()
model, _ = tiny_model("llama")
model = add_adapters(model, {"a": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
                             "b": dict(r=8, lora_alpha=8, target_modules=ALL_LINEAR)}).to(DEVICE)
input_ids, mask = make_batch(3, 5)
names = ["a", "__base__", "b"]
outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
with torch.no_grad():
    got = model(input_ids, attention_mask=mask, adapter_names=names).logits
close(got, stitch(outs, names), "through the harness")
assert is_csgmv_enabled(model), "the harness did not enable csgmv"
assert plugin._LOG["csgmv_calls"] == 1, plugin._LOG
assert csgmv_stats(model)["plans_cached"] >= 1, "csgmv's forward did not take the call: no plan was built"
with torch.no_grad():
    seqs = model.generate(input_ids=input_ids, attention_mask=mask, adapter_names=names, max_new_tokens=2,
                          do_sample=False, pad_token_id=0)
assert seqs.shape == (3, 7)
print("ok")
"""


def test_the_peer_harness_sends_calls_with_adapter_names_through_csgmv():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.path.join(ROOT, "benchmarks", "peft_tests"), os.path.join(ROOT, "tests")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PEER_MODE="csgmv"),
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
