// The MoE operator's C++ interface: buffers in, buffers out; no torch dependency.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace moe {

// Avx2 = AVX2 + FMA + F16C (Zen 2/3, Intel before Ice Lake, most cloud VMs); AvxVnni = Avx2 + AVX-VNNI
// (vpdpbusd on ymm: Intel 12th gen desktops and later without AVX-512, Zen 5); Avx512 = AVX-512 F/BW +
// BF16 + VNNI (Zen 4+, Sapphire Rapids+); Amx = Avx512 + AMX tiles for prefill.
enum class Isa { Portable, Avx2, AvxVnni, Avx512, Amx };
// the 256-bit paths: AvxVnni runs Avx2's kernels except for the int8 x int8 dot products
inline bool ymm_path(Isa isa) { return isa == Isa::Avx2 || isa == Isa::AvxVnni; }
enum class Fmt { Bf16, Int8, Int4, Mxfp4, Fp8, Int4G32, Iq4Nl, UInt4G32, Int8G32, Q4K, Q6K, Iq4Xs, Q5K, Q3K, Q2K,
               Iq2Xxs, Iq2Xs, Iq2S, Iq3Xxs, Iq3S, Iq1S, Iq1M };  // the IQ types: GGUF's grid types as stored

// Bytes of one packed weight row of Kp elements.
inline size_t weight_row_bytes(Fmt f, int Kp) {
  if (f >= Fmt::Iq2Xxs) {  // the IQ types: the file's bytes a 256 (kernels/gemm_iq.h's iq_data_bytes)
    constexpr int per256[] = {64, 72, 80, 96, 104, 48, 48};
    return size_t(Kp) / 256 * per256[int(f) - int(Fmt::Iq2Xxs)];
  }
  return f == Fmt::Bf16 ? size_t(Kp) * 2 : f == Fmt::Int8 || f == Fmt::Fp8 || f == Fmt::Int8G32 ? size_t(Kp)
       : f == Fmt::Q6K ? size_t(Kp) / 4 * 3 : f == Fmt::Q5K ? size_t(Kp) / 8 * 5 : f == Fmt::Q3K ? size_t(Kp) / 8 * 3 : f == Fmt::Q2K ? size_t(Kp) / 4
       : size_t(Kp) / 2;
}

constexpr int INT4_GROUP = 64;  // int4: one scale per 64 consecutive weights of a row
constexpr int MX_BLOCK = 32;    // mxfp4: one power-of-two scale per 32 (OCP MX, as gpt-oss publishes)
constexpr int FP8_BLOCK = 128;  // fp8: one scale per 128 x 128 block (DeepSeek-V3's weight_block_size)

struct CpuFeatures {
  bool avx512f, avx512bw, avx512bf16, avx512vnni, amx_tile, amx_bf16, amx_int8, os_avx512, os_amx;
  bool avx512vbmi;  // byte permutes: the fp8 kernels' lookup (Ice Lake, Sapphire Rapids, Zen 4; not Cooper Lake)
  bool avx2, fma, f16c, avxvnni, os_avx;  // os_avx: the OS saves the ymm state (XCR0 bits 1-2)
};

CpuFeatures detect_cpu();
Isa best_isa(const CpuFeatures& f);
const char* isa_name(Isa isa);
bool isa_supported(Isa isa, const CpuFeatures& f);

// One projection for all experts, rows x K per expert, each row padded to Kp elements.
//   bf16: w = uint16 [E, rows, Kp]
//   int8: w = int8 [E, rows, Kp]; scale = fp32 [E, rows]; rowsum = int32 [E, rows] (sum of the row)
//   int4, mxfp4, int4g32, iq4nl, uint4g32, int8g32, q4k, q5k, q6k, q3k, q2k, iq4xs: the grouped int formats, in row-interleaved blocks
//         (gemm_blocked.h): rows in blocks of 16 (the last block of a matrix may have fewer, n), a block's bytes
//         (n rows' worth, at row 16b's offset) 32 weights at a time; those as chunk vectors, lane j (4 bytes)
//         holding row j's 4 weights of a chunk (elements 4c..4c+3 of the 32). Nibble formats: 4 vectors a 32,
//         chunk v in the low nibbles and chunk v + 4 in the high ones; int8g32: 8 vectors of int8 bytes.
//         scale [E, rows, Kp/group] in the same blocks: per block, group by group, its n rows' scales. No rowsum
//         or rowcorr (their kernels take the activations as s8).
//         - int4: nibble q stands for q - 8; an fp32 scale per 64 (two 32s);
//         - mxfp4: nibble c is the e2m1 code of 2 * value, i.e. {0, 1, 2, 3, 4, 6, 8, 12}, bit 3 the sign
//           (MX4_LUT); scale = uint8 per 32: the block's published exponent e (scale 2^(e - 127); the kernels use
//           2^(e - 128), 0 for e <= 1). Bit-exact with the published weights, 4.25 bits a weight;
//         - int4g32: nibble q stands for q - 8, an fp32 scale per 32 (int4 checkpoints' groups of 32 x n, their
//           scales repeated per 32);
//         - iq4nl: nibble c is the code of ggml's IQ4_NL grid (-127..113), an fp32 scale per 32: GGUF's IQ4_NL and
//           IQ4_XS kept exactly (their fp16 x 6-bit scales in fp32);
//         - uint4g32: nibble q stands for itself, w = scale * q - min; scale = fp32 [E, 2 rows, Kp/32]: an expert's
//           scales, then its mins in the same blocks. GGUF's Q4_K / Q4_1, AWQ / GPTQ zero points;
//         - int8g32: int8 bytes, an fp32 scale per 32. GGUF's Q8_0 kept exactly (its fp16 scales in fp32);
//         - q4k: nibble q stands for itself, w = d sc q - dmin m, GGUF's Q4_K as stored: per 256 weights an fp32
//           d and dmin, per 32 a 6-bit sc and m (a byte each). scale = uint8 [E, rows, Kp/256 x 24]: per block and
//           256, its n rows' d (fp32), then their dmin, then the 8 sc bytes (32 by 32, n each), then the 8 m bytes.
//         - q5k: 5-bit q stands for itself, w = d sc q - dmin m, GGUF's Q5_K as stored: q4k's scales; a 32's bytes:
//           the 4 nibble vectors (q's low 4 bits, as above), then 1 vector of its high bits (chunk c's at bit c of
//           the lane's byte). 5.75 bits a weight.
//         - q6k: 6-bit u stands for u - 32, w = d sc (u - 32), GGUF's Q6_K as stored: per 256 weights an fp32 d,
//           per 16 an int8 sc. A 32's bytes: the 4 nibble vectors (u's low 4 bits, as above), then 2 vectors of its
//           high 2 bits (vector 0: chunk c's at bits 2c, 2c + 1 of the lane's byte, c < 4; vector 1: chunks 4-7).
//           scale = uint8 [E, rows, Kp/256 x 20]: per block and 256, its n rows' d (fp32), then the 16 sc bytes
//           (16 by 16, n each). 6.625 bits a weight.
//         - q3k: 3-bit u stands for u - 4, w = d sc (u - 4), GGUF's Q3_K as stored (its 6-bit scales less 32 as
//           int8): q6k's scales; a 32's bytes: 2 vectors of u's low 2 bits (vector 0: chunk c's at bits 2c, 2c + 1 of
//           the lane's byte, c < 4; vector 1: chunks 4-7), then 1 vector of its high bits (chunk c's at bit c).
//           3.625 bits a weight.
//         - q2k: 2-bit q stands for itself, w = d sc q - dmin m, GGUF's Q2_K as stored: per 256 weights an fp32 d and
//           dmin, per 16 a 4-bit sc and m (one byte, sc in the low nibble, as the file's). A 32's bytes: q3k's 2
//           vectors of low bit pairs alone. scale = uint8 [E, rows, Kp/256 x 24]: per block and 256, its n rows' d
//           (fp32), then their dmin, then the 16 sc | m << 4 bytes 32 by 32:
//           a 32's two bytes of each row side by side (2n each). 2.75 bits a weight.
//         - iq4xs: iq4nl's codes, w = d sc IQ4NL[code], GGUF's IQ4_XS as stored: per 256 weights an fp32 d, per 32 an
//           int8 sc (the file's 6-bit ls - 32). scale = uint8 [E, rows, Kp/256 x 12]: per block and 256, its n rows' d
//           (fp32), then the 8 sc bytes (32 by 32, n each). 4.375 bits a weight (iq4nl: 5).
//   iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq1m: GGUF's grid types as stored, in row-interleaved blocks: w = uint8
//         [E, rows, Kp/256 x the type's per-32 field bytes x 8], per block and 256 each per-32 field's 8 chunks (the
//         block's rows' bytes side by side); scale = uint8 [E, rows, Kp/256 x its per-256 field bytes] (d as fp16;
//         IQ3_S: and its 4 scale bytes; IQ1_M: its 8 scale bytes holding d): the file's bytes, moved
//         (moe_kernels/iq_formats.py's SPECS, kernels/gemm_iq.h).
//   fp8:  w = uint8 [E, rows, Kp], e4m3 (float8_e4m3fn) bytes as published; scale = fp32
//         [E, ceil(rows/128), ceil(Kp/128)]: the block's published scale_inv times 256 (the kernels widen a
//         byte through fp16 bits that read as its value / 256). Activations: fp32 rows of Kp, each followed by
//         its bf16 rounding (gemm_fp8.cpp).
// The callers give int formats' activations as u8 = q + 128 (VNNI multiplies unsigned by signed); int8 takes the
// +128 back out with rowsum, which depends on the row only; the grouped formats flip them to s8.
struct Matrix {
  const void* w;
  const float* scale;  // mxfp4: uint8 exponents, cast back by its kernels
  const int32_t* rowsum;
  const float* rowcorr;
  int rows, K, Kp;
};

// The experts' activation: SwiGLU, silu(gate) * up; or gpt-oss's clamped variant,
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit); or DeepSeek-V4's clamped SiLU,
// silu(min(gate, limit)) * clamp(up, -limit, limit).
enum class Act { Silu = 0, ClampedSwiglu = 1, ClampedSilu = 2 };

struct MoEWeights {
  int E, H, I;
  Matrix gate_up;  // rows 2I (gate then up), K = H
  Matrix down;     // rows H, K = I
  const float* gate_up_bias = nullptr;  // [E, 2I] fp32 (gate then up), or none
  const float* down_bias = nullptr;     // [E, H] fp32, or none
  Act act = Act::Silu;
  float alpha = 0.f, limit = 0.f;       // ClampedSwiglu's (ClampedSilu's limit)
};

// Experts a token may name in one request: the deferral split sorts them on the stack (moe_part.cpp).
// Models above it are refused when their experts load.
constexpr int MAX_K = 256;

struct Kernels;  // kernels.h: one (ISA, format) pair's functions

// A layer's routed experts bound to the kernels that run them: built once, when the layer loads (the ISA
// checked against the CPU then), used by every call and by the shared-memory ring. gate/up and down may be held
// in different formats (a GGUF Q4_K_M file's Q4_K gate/up beside its Q6_K down, each kept as stored): each
// matrix has its own kernels, and each phase quantizes its activations for its own.
struct MoELayer {
  const Kernels* gate_up_k;
  const Kernels* down_k;
  MoEWeights w;
};

// hidden [T, H] fp32, ids [T, k] int32, weights [T, k] fp32 -> out [T, H] fp32.
void moe_forward(const MoELayer& l, const float* hidden, const int32_t* ids, const float* weights, float* out, int T,
                 int k);

// Dense layer: y [T, m.rows] fp32 = x [T, m.K] fp32 times matrix 0 of m, transposed (native/kernels/linear.cpp).
void linear_forward(const Kernels& kn, const Matrix& m, const float* x, int T, float* y);
// G matrices of one shape and format (DeepSeek-V4's grouped output projection), x [T, G, K] -> y [T, G, rows]: group g
// of each token through ms[g], in one pass of the pool (the same values as G linear_forward calls)
void linear_groups(const Kernels& kn, const Matrix* ms, int G, const float* x, int T, float* y);
// The KV cache's element type, which may differ from the model's (--kv-cache-dtype: fp16 halves an fp32 model's
// cache and the bytes decode attention reads). The values are the Python side's codes (moe_kernels/attention.py).
// I8 and F8 are 8-bit rows (moe_kernels/kv_quant.py): a row of n values is n codes (int8, or fp8 e4m3) and one
// byte more, the row's scale as a power of two (E8M0: 2^(byte - 127)); value = code x scale.
enum class KvType : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, F8 = 4 };
inline bool kv_quantized(KvType kv) { return kv == KvType::I8 || kv == KvType::F8; }
// Bytes of a row of n values of kv (a quantized row's scale included); its stride within a pool is that many
// elements of a byte (the quantized pools are byte tensors).
inline size_t kv_row_bytes(KvType kv, int n) {
  return kv_quantized(kv) ? size_t(n) + 1 : size_t(n) * (kv == KvType::F32 ? 4 : 2);
}
// Bytes of one element as the pool's strides count them (a quantized pool's are bytes).
inline size_t kv_elem_bytes(KvType kv) { return kv == KvType::F32 ? 4 : kv_quantized(kv) ? 1 : 2; }
// One row of n values of src (bf16 bits or fp32) into dst as kv: rounded to nearest even as torch's .to() does, or
// quantized as moe_kernels/kv_quant.py's quantize (its row's codes and scale byte, the same bits).
void store_kv(KvType kv, const void* src, bool src_bf16, void* dst, int n);
// out [nh, dv] fp32 = softmax(q K^T * scale) V for one decode query per head (q [nh, d] fp32), K [nkv, L, d] and V
// [nkv, L, dv] of type kv at the given head and position strides (elements: bytes for 8-bit rows, whose stride is at
// least d + 1, dv + 1); nh / nkv query heads per kv head. sel (paged only; MiniMax-M3's block-sparse layers): kv head h reads the
// sel_len[h] <= L positions sel[h * sel_stride ..] (ascending) instead of positions 0..L-1. sinks (null: none): per
// query head one more logit in its softmax whose share is dropped (attention sinks: gpt-oss, MiMo, DeepSeek-V4).
void decode_attention(Isa isa, const float* q, int nh, int nkv, int d, int dv, const void* K, KvType kv,
                      size_t k_head, size_t k_row, const void* V, size_t v_head, size_t v_row, int L, float scale,
                      float* out,
                      const int32_t* table = nullptr, int block_shift = 0, size_t k_block = 0, size_t v_block = 0,
                      const int32_t* sel = nullptr, const int32_t* sel_len = nullptr, size_t sel_stride = 0,
                      const float* sinks = nullptr);

// The delta rule's recurrence over t tokens for H heads (native/kernels/delta_rule.cpp): q, k, e [t, H, dk] (q's scale
// and both l2 norms applied; e the decay per key channel, or with per_head [t, H]: one a head, gated DeltaNet's),
// v [t, H, dv], beta [t, H], S [H, dk, dv]; per token S <- e S + k delta^T and o = (q e)^T S_old + (q . k) delta
// [t, H, dv], delta = beta (v - k^T e S_old); the final state into S_new (another buffer: S is kept); fp32.
void delta_rule_step(Isa isa, int H, int t, int dk, int dv, const float* q, const float* k, const float* v,
                     const float* e, const float* beta, const float* S, float* S_new, float* o, bool per_head = false);

// A hyper-connection's mix for n rows (native/kernels/hyper_mix.cpp): the streams h [n, hc, H] (bf16 or fp32), the
// mixing weight fn [hc (2 + hc), hc H], base [hc (2 + hc)] and scale [3] fp32 -> post [n, hc], comb [n, hc, hc] (fp32)
// and the block's input x [n, H] (h's type), as gpu_service/model/hyper_connections.py mix.
void hyper_mix(Isa isa, int n, int hc, int H, const void* h, bool bf16, const float* fn, const float* base,
               const float* scale, float eps, float norm_eps, int iters, float* post, float* comb, void* x);
// The expand after the block (hyper_connections.expand, the reference, with torch's roundings): out [n, hc, H] =
// post [n, hc] spread over y [n, H] plus comb [n, hc, hc] (fp32) mixing the streams h [n, hc, H]; h, y, out bf16 or
// fp32 alike.
void hyper_expand(Isa isa, int n, int hc, int H, const void* h, bool bf16, const void* y, const float* post,
                  const float* comb, void* out);

// Causal prefill attention (native/kernels/prefill_attention.cpp): out [t, nh, dv] fp32 = softmax(q K^T * scale) V
// where query i (position start + i) sees keys 0 .. start + i; q [t, nh, d] (tokens q_tok, heads q_head elements
// apart, unit stride along d), K [nkv, start + t, d] and V [nkv, start + t, dv] at the given head and position strides,
// all bf16 (bf16 true: AVX-512 paths) or all fp32; nh / nkv query heads per kv head. K's and V's rows start at
// position lo (at most the first any query sees); window > 0: query i sees only keys start + i - window + 1 ..
// start + i; sinks (null: none): per query head one more logit in its softmax whose share is dropped.
void prefill_attention(Isa isa, const void* q, bool bf16, int t, int nh, int nkv, int d, int dv, size_t q_tok,
                       size_t q_head, const void* K, size_t k_head, size_t k_row, const void* V, size_t v_head,
                       size_t v_row, int start, float scale, float* out, int lo = 0, int window = 0,
                       const float* sinks = nullptr);

// MLA's decode attention in the latent space (DeepSeek V2/V3, absorbed): out [nh, r] fp32 = softmax(scores) C, where
// scores[h, j] = (q[h, :r] . C_j + q[h, r:] . KPE_j) * scale, q [nh, r + dr] fp32 (each head's latent query, then its
// rotary query), C the cached latents (rows of r) and KPE the rotary keys (rows of dr), both of type kv, at the given
// row strides, or paged as decode_attention's (block strides c_block, kpe_block). sel (paged only): the L positions
// read, DeepSeek Sparse Attention's selection (dsa_top_k), instead of positions 0..L-1.
void mla_decode_attention(Isa isa, const float* q, int nh, int r, int dr, const void* C, const void* KPE, KvType kv,
                          size_t c_row, size_t kpe_row, int L, float scale, float* out, const int32_t* table = nullptr,
                          int block_shift = 0, size_t c_block = 0, size_t kpe_block = 0, const int32_t* sel = nullptr);

// DeepSeek Sparse Attention's lightning indexer at decode (native/kernels/dsa.cpp): out[j] = sum over h < H of
// w[h] * max(0, scale * q[h] . K_j) for positions j < L, q [H, D] fp32, K rows of D (fp32, bf16 or 8-bit) k_row apart,
// contiguous or paged as decode_attention's. w null (MiniMax-M3's block indexer): out[h * L + j] = scale * q[h] . K_j,
// each head's own (H <= 64).
void dsa_index_scores(Isa isa, const float* q, const float* w, int H, int D, float scale, const void* K, KvType kv,
                      size_t k_row, int L, float* out, const int32_t* table = nullptr, int block_shift = 0,
                      size_t k_block = 0);
// The min(k, L) positions first in (score descending, position ascending) into out, ascending; returns how many.
int dsa_top_k(const float* scores, int L, int k, int32_t* out);

// MLA's absorbed kv_b_proj (w: [nh * (dn + dv), r], bf16 or fp32; native/kernels/mla.cpp), t tokens, fp32 activations:
// q_lat [nh, t, r] = each head's q_nope (token s, head h at q_nope + s * q_tok + h * dn) times its first dn rows;
// o [t, nh, dv] = each head's o_lat [nh, t, r] times its last dv rows, transposed.
void mla_absorb_q(Isa isa, const void* w, bool w_bf16, int nh, int dn, int dv, int r, const float* q_nope, size_t q_tok,
                  int t, float* q_lat);
void mla_absorb_o(Isa isa, const void* w, bool w_bf16, int nh, int dn, int dv, int r, const float* o_lat, int t,
                  float* o);

// RMSNorm of `rows` rows of n (x and out bf16 or fp32, weight w [n] bf16 or fp32) with torch's rounding: fp32
// statistics, the normalized row rounded to x's dtype, times w in out's dtype; wide: times w in fp32, rounded once
// to out's dtype (DeepSeek-V4's fp32 norm weights) (native/kernels/norm_rope.cpp).
void rms_norm_rows(const void* x, bool x_bf16, const void* w, bool w_bf16, void* out, bool out_bf16, int rows, int n,
                   float eps, bool wide = false);
// Rotary embedding, halves rotated (Llama/Qwen): x, out [T, heads, dim], cos/sin [T, dim/2], all bf16 or all fp32.
void rope_rows(const void* x, void* out, bool bf16, int T, int heads, int dim, const void* cos, const void* sin);
// DeepSeek-V4's heads: x, out [T, heads, D] (bf16 or fp32), each head optionally divided by its RMS (no weight), then
// its trailing 2 pairs dims turned in interleaved pairs by cos/sin [T, pairs] (fp32), with torch's rounding.
void head_rope_rows(const void* x, void* out, bool bf16, int T, int heads, int D, int pairs, const float* cos,
                    const float* sin, float eps, bool norm);

// MLA's projections (DeepSeek V2/V3), absorbed at decode (gpu_service/attention.py mla_attention): q from the input
// norm through q_a, its norm (eps 1e-6) and q_b (or q_proj alone: q_a_k null), [nh, dn + dr] a token; the latent
// and rotary key from kv_a (its first r normed); kv_b [nh (dn + dv), r] (bf16 or fp32) absorbed into the query and
// the output. Rotary: interleaved pairs taken evens then odds (DeepSeek), or halves.
struct MlaPart {
  const Kernels* q_a_k;
  Matrix q_a;         // [q_lora, H], or null with q_b the full q_proj [nh (dn + dr), H]
  const Kernels* q_b_k;
  Matrix q_b;         // [nh (dn + dr), q_lora]
  const Kernels* kv_a_k;
  Matrix kv_a;        // [r + dr, H]
  const void *q_a_norm, *kv_a_norm, *q_a_bias, *kv_a_bias;  // the biases optional
  const void* kv_b;
  bool kv_b_bf16, interleave;
  int r, dn, dr, dv;
};

// An attention block's weights and its layer of the paged KV pool, for decode_block (native/decode/decode_step.cpp): GQA,
// or MLA (mla set: qkv, QK-norm and the q/k/v biases unused; d = dn + dr, rot = dr). Activations, norm weights and
// biases are all of the model dtype (bf16 bits or fp32); the pool's K and V are [nkv, blocks, 1 << block_shift, d]
// of kv, or MLA's latents and rotary keys [blocks, 1 << block_shift, r or dr] (gpu_service/kv_pool.py).
struct DecodeBlock {
  Isa isa;
  bool bf16;
  KvType kv;
  const Kernels* qkv_k;
  Matrix qkv;  // q, k, v rows fused: [(nh + 2 nkv) d, H]
  const Kernels* o_k;
  Matrix o;    // [H, nh d]
  const void *in_norm, *post_norm, *q_norm, *k_norm;  // QK-norm: both or neither
  const void *q_bias, *k_bias, *v_bias, *o_bias;       // each optional
  int H, nh, nkv, d;
  int dv;  // a value head's width (MiMo-V2-Flash's 128 beside keys of 192; else d)
  int rot;  // the first rot dims of a head rotated (GLM's partial rotary), the rest passed through; rot = d: all
  float eps, scale;
  float v_scale;       // the values times this before they are cached, in T (MiMo-V2-Flash; else 1)
  int window;          // keys a query sees, itself included (sliding layers: gpt-oss, MiMo); 0: all
  const float* sinks;  // per query head one more logit whose share is dropped (fp32), or null
  void *K, *V;
  size_t kv_head, kv_block;  // K's elements between heads, between blocks
  size_t v_head, v_block;    // V's
  int block_shift;
  // the MoE layer's router on the post-attention norm, one of: softmax scoring (Qwen-MoE, Mixtral; gate_k): logits
  // in T, softmax in fp32, the top k (descending), renormalized (norm_topk), rounded to T (round_w); on fp32 logits
  // of an fp32 weight (w32), sigmoid scoring (GLM-4.5, DeepSeek-V3's noaux_tc): the choice by sigmoid + correction
  // bias within the top topk_group of n_group groups (groups scored by their two best), weights the sigmoids
  // renormalized (norm_topk) times scaling; or softmax scoring (softmax32: DeepSeek-V2's greedy and
  // group_limited_greedy): the top k of the softmax within the topk_group groups of the highest maxima, times
  // scaling; or none (gate_k and w32 null)
  const Kernels* gate_k;
  Matrix gate;  // [E, H]
  const float* w32;     // [E, H] fp32
  const float* bias32;  // [E] fp32, or null
  bool softmax32;
  int E, n_group, topk_group;
  float scaling;
  int top_k;
  bool norm_topk, round_w;
  bool mla;
  MlaPart m;
  bool routes() const { return gate_k != nullptr || w32 != nullptr; }
};
// One sequence's new token: its position, its block table (the pool's blocks holding positions 0..pos), and
// first >= 0 when those are the consecutive blocks first, first + 1, ... (read without the table).
struct DecodeSeq {
  const int32_t* table;
  int32_t pos, first;
};
// For B sequences of one new token each: h [B, H] (the residual stream, updated in place) -> x_out [B, H], the
// post-attention norm of the new h; the new K/V rows written to the pool. cos/sin [B, rot/2]. With a router: ids
// [B, top_k] int32 and weights [B, top_k] fp32 too.
void decode_block(const DecodeBlock& g, int B, void* h, const void* cos, const void* sin, const DecodeSeq* seqs,
                  void* x_out, int32_t* ids = nullptr, float* weights = nullptr);
// The softmax router's choice for B rows of fp32 logits [B, E] (already rounded as the model holds them); with
// topk_group < n_group only the experts of the topk_group groups whose best probability is highest (DeepSeek-V2's
// group_limited_greedy); the weights times scaling.
void softmax_topk(const float* logits, int B, int E, int k, bool norm_topk, bool round_bf16, int32_t* ids,
                  float* weights, int n_group = 1, int topk_group = 1, float scaling = 1.f);

// The sigmoid router's choice for B rows of fp32 logits [B, E] (layers.route's sigmoid branch; ids in descending
// order of choice).
void sigmoid_topk(const float* logits, const float* bias, int B, int E, int k, int n_group, int topk_group,
                  bool norm_topk, float scaling, int32_t* ids, float* weights);

// A SwiGLU MLP at decode (a dense layer, or an MoE layer's shared experts), rounded where the torch path
// (Model._mlp / _shared) rounds: gate and up in T, silu(gate) in T, their product in T, down in T; with Qwen2-MoE's
// gate, sigmoid(x . gate) in T times that (native/decode/decode_mlp.cpp).
struct Mlp {
  bool bf16;
  const Kernels* gate_up_k;
  Matrix gate_up;  // [2I, H]: the gate's rows, then the up's
  const Kernels* down_k;
  Matrix down;     // [H, I]
  const Kernels* gate_k;
  Matrix gate;     // [1, H], or gate_k null: none
};
// x [B, H] -> y [B, H], both in T (bf16 bits or fp32). Holds no lock: the caller holds compute_mutex().
void mlp_forward(const Mlp& m, int B, const void* x, void* y);
// Throws unless m's matrices fit each other (what mlp_forward checks, at once where one is bound).
void check_mlp(const Mlp& m);

// One part of a deferral split (part 0: the k - defer highest-weighted experts of each token,
// part 1: the defer lowest; defer = 0: all), hidden and out each bf16 or fp32; checks ids and
// finiteness (throws std::invalid_argument naming the field).
void moe_forward_part(const MoELayer& l, const void* hidden, bool hidden_bf16, const int32_t* ids,
                      const float* weights, void* out, bool out_bf16, int T, int k, int defer, int part);

// Activations as the kernels take them: bf16 rows, (int formats) uint8 rows q + 128 with one
// scale per row, or (fp8) fp32 rows (then their bf16 rounding), scaled per weight block by its kernels.
struct Acts {
  const void* const* rows;          // one pointer per slot
  const float* scale;               // per slot (int formats)
  const uint8_t* amx_b = nullptr;   // AMX path: the same slots packed by pack_amx_b (from slot 0), or none
};

// The row kernels, per format and ISA, are in kernels.h.

// AMX (prefill, bf16 and int8 weights here; fp8, int4, int4g32, iq4nl, mxfp4 and int8g32 tile their own). amx_permitted() asks the OS for the
// tile state once.
constexpr int AMX_MIN_SLOTS = 8;  // fewer tokens per expert: the AVX-512 kernels do as well
bool amx_permitted();
size_t amx_b_bytes(Fmt fmt, int ns, int Kp);
void pack_amx_b(Fmt fmt, const Acts& x, int ns, int Kp, uint8_t* dst);
// rows [r0, r1) must be whole 16-row tiles and x.amx_b set
// Tests on machines without AMX: the tile instructions replaced by plain C++ (slow, same layouts).
void set_amx_emulation(bool on);
bool amx_emulation();
void gemm_rows_amx(Fmt fmt, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
float amx_peak_loop(bool bf16, long iters);  // iters x 4 tile multiplies (probes.cpp times it)
// The tile configuration (every tile 16 rows x 64 bytes, or K = 32's), loaded and released around a call's tile
// work by the kernels that keep their own tile loops (kernels/amx/gemm_blocked_amx.h).
void amx_tiles_begin(int k_bytes = 64);  // 32 (16): A tiles of 16 x 32 (16) bytes, B tiles of 8 (4) rows: K = 32 (16) a product
void amx_tiles_end();

}  // namespace moe
