"""The Gluon kernels (paged prefill, MLA decode, V4's sparse attention)
compiled for sm_90 on the CPU, with the installed Triton: no GPU runs them
here, so this is what tells a CPU CI that a change (or a new Triton) left
them compiling (on a GPU a kernel that does not compile falls back to
Triton's, silently slower). Each build is checked for what makes it that
kernel: its wgmma products, registers moved between partitions
(setmaxnreg), shared memory within the 227 KB a block may use on sm_90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")

# Compiled in a process of its own: the test session runs Triton's
# interpreter (TRITON_INTERPRET=1 from conftest.py), which compiles nothing.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl

def desc(block, smem):
    layout = gl.NVMMASharedLayout.get_default_for(smem, gl.bfloat16)
    return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

which = sys.argv[1]
if which == "prefill":
    import tinyengine.kernels.attention.gluon as m
    kernel = m._prefill_gluon
    sig = {"q_desc": desc([128, 128], [128, 128]), "k_desc": desc([16, 128], [128, 128]),
           "v_desc": desc([16, 128], [128, 128]), "out_ptr": "*bf16", "block_tables_ptr": "*i32",
           "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "qk_scale": "fp32",
           "num_seqs": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32",
           "stride_qh": "i32", "stride_kvh": "i32"}
    consts = dict(GROUP=4, BLOCK_SIZE=16, NUM_STAGES=m.NUM_STAGES)
elif which == "sparse":
    import tinyengine.kernels.sparse_attention.gluon as m
    from tinyengine.kernels.sparse_attention.split import TOPK_ENTRIES
    kernel = m._sparse_split_gluon
    ptrs = ("q_ptr", "kv_ptr", "tables_ptr", "seq_lens_ptr", "seqs_ptr", "topk_ptr", "picks_ptr",
            "sinks_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr")
    sig = {name: "*bf16" if name in ("q_ptr", "kv_ptr", "out_ptr") else
           "*fp32" if name in ("sinks_ptr", "part_out_ptr", "part_lse_ptr") else "*i32"
           for name in ptrs}
    sig.update({"entry_offset": "i64", "table_delta": "i64", "qk_scale": "fp32",
                "num_splits": "i32", "num_heads": "i32", "topk": "i32"})
    for name in ("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_eb", "stride_er",
                 "stride_bt", "stride_ebt", "stride_topk", "stride_ot", "stride_oh"):
        sig[name] = "i32"
    sig = {name: sig[name] for name in kernel.arg_names if name in sig}
    consts = dict(D=512, BLOCK_H=64, BLOCK_N=m.TILE_N, BLOCK_SIZE=64, WINDOW=128, RATIO=4,
                  MODE=TOPK_ENTRIES, HAS_SEQS=False, DIRECT=False, NUM_STAGES=m.NUM_STAGES)
else:
    import tinyengine.kernels.mla.gluon as m
    kernel = m._mla_split_gluon
    page = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sig = {"q_lat_ptr": "*bf16", "q_rope_ptr": "*bf16",
           "lat_desc": f"tensordesc<bf16[64, 512],{page!r}>",
           "rope_desc": f"tensordesc<bf16[64, 64],{page!r}>", "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "qk_scale": "fp32", "num_splits": "i32", "num_heads": "i32"}
    for name in ("stride_qlb", "stride_qlh", "stride_qrb", "stride_qrh", "stride_bt",
                 "stride_ob", "stride_oh"):
        sig[name] = "i32"
    consts = dict(LATENT=512, ROPE=64, BLOCK_H=64, BLOCK_N=64, BLOCK_SIZE=64, DIRECT=False,
                  NUM_STAGES=m.NUM_STAGES)
sig.update({name: "constexpr" for name in consts})
names = list(sig)
# What a launch specializes on: 16-byte aligned pointers, strides multiples of 16.
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
         if sig[n].startswith("*") or n.startswith("stride")}
compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=m.MAXNREG))
ptx = compiled.asm["ptx"]
print(json.dumps({"shared": compiled.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                  "setmaxnreg": ptx.count("setmaxnreg")}))
"""


@pytest.mark.parametrize(("kernel", "wgmmas"), [("prefill", 64), ("mla", 44), ("sparse", 76)])
def test_gluon_kernel_compiles_for_sm90(kernel: str, wgmmas: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, kernel], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    # The products of a tile: prefill 2 consumers x (QK 8 + PV 8) k-steps,
    # each emitted twice (the first tile's QK and the last tile's PV are
    # outside the loop);
    # MLA its scores (latent and rope) and both output halves; the sparse
    # kernel each warpgroup's 32-key scores and output halves.
    assert built["wgmma"] == wgmmas, built
    assert built["setmaxnreg"] > 0, "the partitions no longer get their own register counts"
    assert 0 < built["shared"] <= 227 * 1024, built
