"""Packed expert weights read back as the kernels' references read them: every format's values exactly as
stored, in fp32 [E, rows, K], and fp8's rows multiplied as its kernels multiply them (float64)."""
import torch
import torch.nn.functional as F


class Fp8Rows:
    """One projection of packed fp8 experts, multiplied as the kernels do: each 128-row block's rows times
    the vector scaled by that block row's scales, rounded to bf16 (native/kernels/gemm_fp8.cpp); in float64."""
    def __init__(self, packed, r0, r1, K):
        from moe_kernels.packing import FP8_BLOCK
        data, scale = packed[0], packed[1]
        self.values = data.view(torch.float8_e4m3fn).double() / 256
        self.scale = scale.double().repeat_interleave(FP8_BLOCK, 2)[..., :data.shape[2]]  # [E, row blocks, Kp]
        self.r0, self.r1, self.K, self.block = r0, r1, K, FP8_BLOCK
        self.shape = (data.shape[0], r1 - r0, K)

    def __getitem__(self, e):
        def mv(v):
            vp = F.pad(v.double(), (0, self.values.shape[2] - self.K))
            xs = (vp * self.scale[e]).bfloat16().double()                      # [row blocks, Kp]
            rows = torch.arange(self.r0, self.r1)
            return (self.values[e, rows] * xs[rows // self.block]).sum(-1).float()
        return mv


def dequantized(op):
    """The weights exactly as the packed format stores them, back in fp32 [E, rows, K] (fp8: Fp8Rows)."""
    from moe_kernels.packing import unpack

    if op.fmt == "fp8":
        I, H = op.intermediate, op.hidden
        return Fp8Rows(op.gu, 0, I, H), Fp8Rows(op.gu, I, 2 * I, H), Fp8Rows(op.dn, 0, H, I)
    gu = unpack(op.gu, op.fmt, op.hidden)
    I = op.intermediate
    return gu[:, :I], gu[:, I:], unpack(op.dn, op.down_fmt, I)
