"""Compile every kernel variant for the GPU (Hopper, sm_90) ahead of time, without a GPU. Run in a process without
``TRITON_INTERPRET`` (tests/test_compile.py does). Prints one line per variant; exits non-zero on a compile error,
77 when this Triton cannot compile for CUDA here (no CUDA backend or no bundled ptxas)."""

from __future__ import annotations

import importlib
import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # pragma: no cover - other Triton layouts
    print(f"skip: {e}")
    sys.exit(77)

shrink = importlib.import_module("peft_csgmv.kernels.shrink")
expand = importlib.import_module("peft_csgmv.kernels.expand")
embedding = importlib.import_module("peft_csgmv.kernels.embedding")
launch = importlib.import_module("peft_csgmv.kernels.launch")

PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
INTS = {"perm_ptr": "*i32", "seg_indptr_ptr": "*i32", "seg_slot_ptr": "*i32", "rank_ptr": "*i32"}


def compile_variant(kernel, pointer_types: dict, constexprs: dict) -> None:
    """Compile ``kernel`` with the given pointer types; every other runtime argument (sizes, strides such as
    ``stride_ids``) is an unspecialized i32, as each name comes from the kernel's own signature."""
    names = kernel.arg_names
    if "USE_GDC" in names:  # launched with programmatic dependent launch or not (a variant says which)
        constexprs = {"USE_GDC": False, **constexprs}
    if "ADD_Y" in names:  # the expand's output holds y plus the LoRA, or the LoRA alone (a variant says which)
        constexprs = {"ADD_Y": True, **constexprs}
    unknown = set(pointer_types) - set(names)
    if unknown:
        raise ValueError(f"{kernel.fn.__name__} has no argument(s) {sorted(unknown)}")
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    if not compiled.asm.get("cubin"):
        raise RuntimeError("no cubin produced")
    ptx = compiled.asm.get("ptx", "")
    if bool(constexprs.get("USE_GDC")) != ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx):
        raise RuntimeError(f"USE_GDC={constexprs.get('USE_GDC')} but the PTX disagrees on griddepcontrol")


def expand_types(b: str, y: str, a: str) -> dict:
    """Pointer types of the expand kernel: B of ``b``, y / out / x of ``y``, A (read when fused) of ``a``."""
    types = {"t_ptr": "*fp32", "b_ptr": b, "y_ptr": y, "out_ptr": y, "x_ptr": y, "a_ptr": a, **INTS}
    types.update(scaling_ptr="*fp32", mag_ptr="*fp32", bias_ptr="*fp32", lbias_ptr="*fp32", b_off_ptr="*i64")
    types["a_off_ptr"] = "*i64"
    return types


def variants():
    for dtype, block_m in itertools.product(PTR, (16, 128)):
        types = {"x_ptr": PTR[dtype], "a_ptr": PTR[dtype], "t_ptr": "*fp32", **INTS, "a_off_ptr": "*i64"}
        cx = dict(BLOCK_M=block_m, BLOCK_R=64, BLOCK_K=64 if block_m >= 64 else 128)
        cx["DOT_PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
        for pooled in (False, True):  # padded stacks (any strides) and weights pooled at their own ranks
            cx.update(POOLED=pooled, ALIGN=16 if pooled else 1)
            yield f"shrink {dtype} M{block_m} pooled={pooled}", shrink._shrink_kernel, types, dict(cx)
    # fp32 adapters (PEFT's default) on a bf16 model: TF32 products
    types = {"x_ptr": PTR["bf16"], "a_ptr": PTR["fp32"], "t_ptr": "*fp32", **INTS, "a_off_ptr": "*i64"}
    cx = dict(BLOCK_M=16, BLOCK_R=64, BLOCK_K=128, DOT_PRECISION="tf32", POOLED=True, ALIGN=16)
    yield "shrink bf16 x, fp32 A", shrink._shrink_kernel, types, cx
    for dtype, (dora, lora_bias) in itertools.product(PTR, ((False, False), (True, False), (False, True))):
        types = expand_types(PTR[dtype], PTR[dtype], PTR[dtype])
        cx = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        cx.update(HAS_DORA=dora, HAS_LORA_BIAS=lora_bias, POOLED=dora, ALIGN=16 if dora else 1, RANK_ALIGN=1)
        cx.update(FUSED=False, BLOCK_K=16)
        for out_of_place in (False, True):  # in place (eager), out of place over base segments (compiled)
            cx["OUT_OF_PLACE"] = out_of_place
            label = f"expand {dtype} dora={dora} lora_bias={lora_bias} out_of_place={out_of_place}"
            yield label, expand._expand_kernel, types, dict(cx)
    types = expand_types(PTR["fp32"], PTR["bf16"], PTR["fp32"])
    cx = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="tf32", HAS_DORA=False, HAS_LORA_BIAS=False)
    cx.update(FUSED=False, BLOCK_K=16)
    for rank_align, out_of_place in ((1, False), (16, False), (16, True)):  # pooled B: row stride a multiple of 16?
        cx.update(POOLED=True, ALIGN=16, RANK_ALIGN=rank_align, OUT_OF_PLACE=out_of_place)
        label = f"expand fp32 B, bf16 y pooled rank_align={rank_align} out_of_place={out_of_place}"
        yield label, expand._expand_kernel, types, dict(cx)
    # the LoRA alone into an fp32 output (compiled decode beside the base product): bf16 and fp32 adapters
    for w in ("bf16", "fp32"):
        types = expand_types(PTR[w], PTR["bf16"], PTR[w])
        types["out_ptr"] = "*fp32"
        cx = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="tf32", HAS_DORA=False, HAS_LORA_BIAS=True)
        cx.update(FUSED=False, BLOCK_K=16, POOLED=True, ALIGN=16, RANK_ALIGN=16, OUT_OF_PLACE=True, ADD_Y=False)
        yield f"expand {w} weights, the LoRA alone into fp32", expand._expand_kernel, types, cx
    # fused (the shrink's product inside the expand): bf16 adapters, fp32 adapters on bf16 activations, DoRA in fp32
    for w, act, dora, out_of_place in (("bf16", "bf16", False, True), ("fp32", "bf16", False, True),
                                       ("fp32", "fp32", True, False)):  # fmt: skip
        cx = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, BLOCK_K=128, HAS_DORA=dora, HAS_LORA_BIAS=False, FUSED=True)
        cx.update(DOT_PRECISION="ieee" if w == act == "fp32" else "tf32", POOLED=True, ALIGN=16, RANK_ALIGN=16)
        cx["OUT_OF_PLACE"] = out_of_place
        label = f"fused {w} weights, {act} activations dora={dora} out_of_place={out_of_place}"
        yield label, expand._expand_kernel, expand_types(PTR[w], PTR[act], PTR[w]), cx
    # programmatic dependent launch (launch.pdl, sm_90+): the decode launches of a bf16 model, in place and compiled
    yield from pdl_variants() if launch._triton_has_pdl() else ()
    for dtype, ids in (("bf16", "*i64"), ("fp32", "*i32")):  # ids of either width, read through stride_ids
        types = {"ids_ptr": ids, "a_ptr": PTR[dtype], "t_ptr": "*fp32", **INTS, "a_off_ptr": "*i64"}
        cx = dict(BLOCK_M=32, BLOCK_R=16, POOLED=dtype == "bf16")
        yield f"embedding_shrink {dtype} ids {ids[1:]}", embedding._embedding_shrink_kernel, types, cx


def pdl_variants():
    types = {"x_ptr": PTR["bf16"], "a_ptr": PTR["bf16"], "t_ptr": "*fp32", **INTS, "a_off_ptr": "*i64"}
    cx = dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=64, DOT_PRECISION="tf32", POOLED=True, ALIGN=16, USE_GDC=True)
    yield "shrink bf16 pdl", shrink._shrink_kernel, types, cx
    for out_of_place, fused, add_y in ((False, False, True), (True, False, True), (True, True, True),
                                       (True, False, False)):  # fmt: skip
        cx = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, BLOCK_K=128, DOT_PRECISION="tf32", HAS_DORA=False)
        cx.update(HAS_LORA_BIAS=False, POOLED=True, ALIGN=16, RANK_ALIGN=16, USE_GDC=True)
        cx.update(OUT_OF_PLACE=out_of_place, FUSED=fused, ADD_Y=add_y)
        types = expand_types(PTR["bf16"], PTR["bf16"], PTR["bf16"])
        if not add_y:
            types["out_ptr"] = "*fp32"
        label = f"expand bf16 pdl out_of_place={out_of_place} fused={fused} add_y={add_y}"
        yield label, expand._expand_kernel, types, cx


def main() -> int:
    for label, kernel, types, cx in variants():
        try:
            compile_variant(kernel, types, cx)
        except (ImportError, FileNotFoundError) as e:
            print(f"skip: this Triton cannot compile for CUDA here: {e}")
            return 77
        except Exception as e:
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                print(f"skip: {e}")
                return 77
            print(f"FAILED {label}: {type(e).__name__}: {e}")
            return 1
        print(f"ok {label}")
    if not launch._triton_has_pdl():
        print("skip: programmatic dependent launch variants (this Triton cannot compile gdc_wait)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
