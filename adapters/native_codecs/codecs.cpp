// rl-refit's native codec kernels: one pass over each block, in cache, with AVX2 where the build has
// it and the same arithmetic in scalar code elsewhere (and for the tail of a row).
//
// Each kernel ports the eager reference of domain/quant/codecs/ operation for operation, in
// float32: the same products, quotients and reciprocals in the same order, so every byte equals
// the reference's (tests/codecs/test_native_path.py checks them on every rounding midpoint and on
// the adversarial blocks). What differs is only how the work is scheduled: a block's maximum is
// taken over the integer bits of |x| (the same order as the float values' for every non-NaN
// value, and a NaN still makes the maximum non-finite, which the caller refuses), and the
// roundings to E4M3 and E2M1 are done on the float's bits (round to nearest even), as
// domain/quant/codecs/elements.py defines them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: x + kMagic - kMagic rounds |x| < 2^22 to an integer, ties to even

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }
inline float clamp(float v, float m) { return std::min(std::max(v, -m), m); }  // NaN stays NaN

// float32 (already clamped to +-448, or NaN) -> float8_e4m3fn byte, round to nearest even.
inline uint8_t e4m3(float f) {
  uint32_t b = bits_of(f), a = b & 0x7FFFFFFFu, sign = (b >> 24) & 0x80u;
  int32_t code;
  if (a > 0x7F800000u) {
    code = 0x7F;
  } else if (a < 0x3C800000u) {  // below 2^-6: subnormal E4M3, steps of 2^-9
    code = static_cast<int32_t>((float_of(a) * 512.0f + kMagic) - kMagic);
  } else {  // keep 3 mantissa bits; rebias the exponent from 127 to 7
    code = static_cast<int32_t>((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120 << 3);
  }
  return static_cast<uint8_t>(code | static_cast<int32_t>(sign));
}

// float32 (clamped to +-6) -> 4-bit E2M1 code, as elements.e2m1_codes.
inline uint8_t e2m1(float f, bool signed_zero) {
  uint32_t b = bits_of(f), a = b & 0x7FFFFFFFu;
  float af = std::min(float_of(a), 8.0f);
  a = bits_of(af);
  int32_t code = af < 1.0f ? static_cast<int32_t>((af * 2.0f + kMagic) - kMagic)
                           : static_cast<int32_t>((a + 0x1FFFFFu + ((a >> 22) & 1u)) >> 22) - 252;
  code = std::min(code, 7);
  bool negative = signed_zero ? (b >> 31) != 0 : f < 0.0f;
  return static_cast<uint8_t>(code | (negative ? 8 : 0));
}

#if defined(__AVX2__)
inline __m256 load_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256i abs_bits(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF)); }

inline uint32_t hmax(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

inline __m256 clamp8(__m256 v, float m) {
  // max then min, as clamp: a NaN lane becomes the bound here, but a block holding a NaN has a
  // non-finite maximum and is refused whatever its bytes
  return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-m)), _mm256_set1_ps(m));
}

inline __m256i e4m3x8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd), 20),
      _mm256_set1_epi32(120 << 3));
  const __m256 magic = _mm256_set1_ps(kMagic);
  __m256 sub_f = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)), magic), magic);
  __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);
  __m256i code = _mm256_blendv_epi8(normal, _mm256_cvttps_epi32(sub_f), is_sub);
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(code, sign);
}

inline __m256i e2m1x8(__m256 v, bool signed_zero) {
  __m256i b = _mm256_castps_si256(v);
  __m256 af = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF))), _mm256_set1_ps(8.0f));
  __m256i a = _mm256_castps_si256(af);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 22), _mm256_set1_epi32(1));
  __m256i from_one = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x1FFFFF)), odd), 22), _mm256_set1_epi32(252));
  const __m256 magic = _mm256_set1_ps(kMagic);
  __m256i below = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(af, _mm256_set1_ps(2.0f)), magic), magic));
  __m256i is_below = _mm256_castps_si256(_mm256_cmp_ps(af, _mm256_set1_ps(1.0f), _CMP_LT_OQ));
  __m256i code = _mm256_min_epi32(_mm256_blendv_epi8(from_one, below, is_below), _mm256_set1_epi32(7));
  __m256i negative = signed_zero ? _mm256_srai_epi32(b, 31)
                                 : _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_or_si256(code, _mm256_and_si256(negative, _mm256_set1_epi32(8)));
}

// four vectors of 8 int32 codes (0..255) -> 32 bytes in order
inline __m256i bytes32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 four-bit codes (one per byte, in order) -> 16 bytes: element 2i low nibble, 2i+1 high
inline __m128i nibbles16(__m256i codes) {
  __m256i pairs = _mm256_or_si256(_mm256_and_si256(codes, _mm256_set1_epi16(0x00FF)),
                                  _mm256_slli_epi16(_mm256_srli_epi16(codes, 8), 4));
  return _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
}
#endif

const uint16_t* bf16_data(const torch::Tensor& w) { return reinterpret_cast<const uint16_t*>(w.data_ptr()); }

void check_input(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "native codecs take contiguous bf16 CPU tensors");
}

}  // namespace

// FP8 block: [M, N, K] bf16 -> (e4m3 bytes [M, N, K], scale f32 [M, nb, kb], amax f32 [M, nb, kb]),
// 128 x 128 blocks. engine: scale = max(amax, 1e-4) / 448, x * (1 / scale); otherwise
// (compressed-tensors): scale = amax / 448 (eps when 0), x / scale.
std::vector<torch::Tensor> fp8_block(torch::Tensor w, bool engine) {
  check_input(w);
  TORCH_CHECK(w.dim() == 3, "fp8_block takes [M, N, K]");
  const int64_t m = w.size(0), n = w.size(1), k = w.size(2), nb = (n + 127) / 128, kb = (k + 127) / 128;
  auto q = torch::empty({m, n, k}, w.options().dtype(torch::kUInt8));
  auto scale = torch::empty({m, nb, kb}, w.options().dtype(torch::kFloat));
  auto amaxes = torch::empty({m, nb, kb}, w.options().dtype(torch::kFloat));
  const uint16_t* x = bf16_data(w);
  uint8_t* qo = q.data_ptr<uint8_t>();
  float* so = scale.data_ptr<float>();
  float* ao = amaxes.data_ptr<float>();
  const float eps = std::numeric_limits<float>::epsilon();
  at::parallel_for(0, m * nb * kb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t mat = blk / (nb * kb), bi = blk / kb % nb, bj = blk % kb;
      const int64_t r0 = bi * 128, r1 = std::min(n, r0 + 128), c0 = bj * 128, c1 = std::min(k, c0 + 128);
      const uint16_t* base = x + mat * n * k;
      uint8_t* out_base = qo + mat * n * k;
      int64_t cv = c0;
      uint32_t top = 0;
#if defined(__AVX2__)
      cv = c0 + (c1 - c0) / 32 * 32;
      __m256i vmax = _mm256_setzero_si256();
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < cv; c += 8) vmax = _mm256_max_epi32(vmax, abs_bits(load_bf16(base + r * k + c)));
      top = hmax(vmax);
#endif
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = cv; c < c1; ++c) top = std::max(top, static_cast<uint32_t>(base[r * k + c]) << 16 & 0x7FFFFFFFu);
      const float amax = float_of(top);
      float s, mult = 0.0f;
      if (engine) {
        s = std::max(amax, 1e-4f) / kE4m3Max;
        mult = 1.0f / s;
      } else {
        s = amax / kE4m3Max;
        s = s == 0.0f ? eps : s;
      }
      so[blk] = s;
      ao[blk] = amax;
      for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* row = base + r * k;
        uint8_t* out = out_base + r * k;
#if defined(__AVX2__)
        const __m256 vm = _mm256_set1_ps(mult), vs = _mm256_set1_ps(s);
        for (int64_t c = c0; c < cv; c += 32) {
          __m256i e[4];
          for (int j = 0; j < 4; ++j) {
            __m256 v = load_bf16(row + c + 8 * j);
            e[j] = e4m3x8(clamp8(engine ? _mm256_mul_ps(v, vm) : _mm256_div_ps(v, vs), kE4m3Max));
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), bytes32(e[0], e[1], e[2], e[3]));
        }
#endif
        for (int64_t c = cv; c < c1; ++c) out[c] = e4m3(clamp(engine ? bf16(row[c]) * mult : bf16(row[c]) / s, kE4m3Max));
      }
    }
  });
  return {q, scale, amaxes};
}

namespace {

// rceil: ceil(log2(amax / elem_max)) + 127, clamped to [0, 254]; 0 for a zero maximum
inline int32_t e8m0_rceil(float amax, float elem_max) {
  const float descale = amax / elem_max;
  if (descale == 0.0f) return 0;
  const uint32_t b = bits_of(descale), biased = b >> 23 & 0xFFu;
  int32_t ceil_log2;
  if (biased != 0 && biased != 0xFFu) {  // a normal float: its exponent, plus one unless a power of two
    ceil_log2 = static_cast<int32_t>(biased) - 127 + ((b & 0x7FFFFFu) != 0 ? 1 : 0);
  } else {  // subnormal, Inf or NaN: frexp, as the reference takes it
    int exponent;
    const float mantissa = std::frexp(descale, &exponent);
    ceil_log2 = mantissa == 0.5f ? exponent - 1 : exponent;
  }
  return std::min(std::max(ceil_log2 + 127, 0), 254);
}

// even: 127 + floor(log2(round_up_pow2(amax))) - emax, clamped to [0, 254]; 0 when the rounded
// maximum is zero
inline int32_t e8m0_even(float amax, int32_t emax) {
  const uint32_t pow2 = (bits_of(amax) + (1u << 21)) & 0x7F800000u;
  if (pow2 == 0) return 0;
  return std::min(std::max(static_cast<int32_t>(pow2 >> 23) - 127 + 127 - emax, 0), 254);
}

// 2^(127 - e) as a float32, e in [0, 254] (2^-127 is a subnormal, exact)
inline float inverse_scale(int32_t e) {
  const int32_t k = 127 - e;
  return k >= -126 ? float_of(static_cast<uint32_t>(k + 127) << 23) : float_of(1u << 22);
}

}  // namespace

// MX: [R, K] bf16, blocks of 32 along K -> (elements [R, K] e4m3 bytes, or [R, K/2] packed E2M1;
// exponents uint8 [R, K/32]; amax f32 [R, K/32, 1]). The elements are x / 2^(e - 127), computed as
// x * 2^(127 - e): both are the exactly rounded x * 2^(127 - e).
std::vector<torch::Tensor> mx(torch::Tensor w, bool e4m3_elements, bool rceil, bool signed_zero, double elem_max,
                              int64_t elem_emax) {
  check_input(w);
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 32 == 0, "mx takes [R, K], K a multiple of 32");
  const int64_t rows = w.size(0), k = w.size(1), kb = k / 32;
  auto q = torch::empty({rows, e4m3_elements ? k : k / 2}, w.options().dtype(torch::kUInt8));
  auto exps = torch::empty({rows, kb}, w.options().dtype(torch::kUInt8));
  auto amaxes = torch::empty({rows, kb, 1}, w.options().dtype(torch::kFloat));
  const uint16_t* x = bf16_data(w);
  uint8_t* qo = q.data_ptr<uint8_t>();
  uint8_t* eo = exps.data_ptr<uint8_t>();
  float* ao = amaxes.data_ptr<float>();
  const float emax_f = static_cast<float>(elem_max);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < kb; ++b) {
        const uint16_t* blk = x + r * k + b * 32;
        uint32_t top = 0;
#if defined(__AVX2__)
        const __m256 v0 = load_bf16(blk), v1 = load_bf16(blk + 8), v2 = load_bf16(blk + 16), v3 = load_bf16(blk + 24);
        top = hmax(_mm256_max_epi32(_mm256_max_epi32(abs_bits(v0), abs_bits(v1)), _mm256_max_epi32(abs_bits(v2), abs_bits(v3))));
#else
        for (int j = 0; j < 32; ++j) top = std::max(top, static_cast<uint32_t>(blk[j]) << 16 & 0x7FFFFFFFu);
#endif
        const float amax = float_of(top);
        const int32_t e = rceil ? e8m0_rceil(amax, emax_f) : e8m0_even(amax, static_cast<int32_t>(elem_emax));
        const float inv = inverse_scale(e);
        ao[r * kb + b] = amax;
        eo[r * kb + b] = static_cast<uint8_t>(e);
#if defined(__AVX2__)
        const __m256 vi = _mm256_set1_ps(inv);
        const __m256 s0 = clamp8(_mm256_mul_ps(v0, vi), emax_f), s1 = clamp8(_mm256_mul_ps(v1, vi), emax_f);
        const __m256 s2 = clamp8(_mm256_mul_ps(v2, vi), emax_f), s3 = clamp8(_mm256_mul_ps(v3, vi), emax_f);
        if (e4m3_elements) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo + r * k + b * 32),
                              bytes32(e4m3x8(s0), e4m3x8(s1), e4m3x8(s2), e4m3x8(s3)));
        } else {
          __m256i codes = bytes32(e2m1x8(s0, signed_zero), e2m1x8(s1, signed_zero), e2m1x8(s2, signed_zero),
                                  e2m1x8(s3, signed_zero));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qo + r * (k / 2) + b * 16), nibbles16(codes));
        }
#else
        for (int j = 0; j < 32; ++j) {
          const float v = clamp(bf16(blk[j]) * inv, emax_f);
          if (e4m3_elements) {
            qo[r * k + b * 32 + j] = e4m3(v);
          } else {
            const uint8_t c = e2m1(v, signed_zero);
            uint8_t& out = qo[r * (k / 2) + b * 16 + j / 2];
            out = j % 2 == 0 ? c : static_cast<uint8_t>(out | (c << 4));
          }
        }
#endif
      }
    }
  });
  return {q, exps, amaxes};
}

namespace {

inline float e4m3_value(uint8_t code) {  // float8_e4m3fn byte (not NaN) -> float32
  const uint32_t exponent = (code >> 3) & 0xFu, mantissa = code & 7u;
  const float magnitude = exponent == 0 ? static_cast<float>(mantissa) * (1.0f / 512.0f)
                                        : float_of(((exponent + 120u) << 23) | (mantissa << 20));
  return (code & 0x80u) ? -magnitude : magnitude;
}

inline float engine_reciprocal(float t) { return 1.0f / (t + (t == 0.0f ? 1e8f : 0.0f)); }  // nvfp4._reciprocal

// One NVFP4 block's multiplier (x * it, engine) or divisor (x / it, compressed-tensors), and its
// scale byte.
struct Nvfp4Block {
  float factor;
  uint8_t scale;
};

inline Nvfp4Block nvfp4_block(float amax, float gs, bool engine) {
  if (engine) {
    const uint8_t code = e4m3(clamp(gs * (amax * static_cast<float>(1.0 / 6.0)), kE4m3Max));
    return {engine_reciprocal(e4m3_value(code) * engine_reciprocal(gs)), code};
  }
  uint8_t code = e4m3(clamp(gs * (amax / kE2m1Max), kE4m3Max));
  float scale = e4m3_value(code);
  if (scale == 0.0f) {
    scale = 0.125f;  // compressed-tensors' eps for e4m3
    code = 0x20;     // 0.125 in e4m3: 2^-3
  }
  return {scale / gs, code};
}

}  // namespace

// NVFP4: [M, R, K] bf16 with one global scale per matrix (gs float32 [M]), blocks of 16 along K
// -> (packed E2M1 [M, R, K/2], scale e4m3 bytes [M, R, K/16], amax f32 [M, R, K/16, 1]).
std::vector<torch::Tensor> nvfp4(torch::Tensor w, torch::Tensor gs, bool engine) {
  check_input(w);
  TORCH_CHECK(w.dim() == 3 && w.size(2) % 16 == 0, "nvfp4 takes [M, R, K], K a multiple of 16");
  TORCH_CHECK(gs.scalar_type() == torch::kFloat && gs.is_contiguous() && gs.numel() == w.size(0),
              "nvfp4 takes one float32 global scale per matrix");
  const int64_t m = w.size(0), rows = w.size(1), k = w.size(2), kb = k / 16;
  auto q = torch::empty({m, rows, k / 2}, w.options().dtype(torch::kUInt8));
  auto scales = torch::empty({m, rows, kb}, w.options().dtype(torch::kUInt8));
  auto amaxes = torch::empty({m, rows, kb, 1}, w.options().dtype(torch::kFloat));
  const uint16_t* x = bf16_data(w);
  const float* g = gs.data_ptr<float>();
  uint8_t* qo = q.data_ptr<uint8_t>();
  uint8_t* so = scales.data_ptr<uint8_t>();
  float* ao = amaxes.data_ptr<float>();
  at::parallel_for(0, m * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float global = g[row / rows];
      const uint16_t* in = x + row * k;
      uint8_t* out = qo + row * (k / 2);
      int64_t b = 0;
#if defined(__AVX2__)
      for (; b + 2 <= kb; b += 2) {
        const uint16_t* blk = in + b * 16;
        const __m256 v0 = load_bf16(blk), v1 = load_bf16(blk + 8), v2 = load_bf16(blk + 16), v3 = load_bf16(blk + 24);
        const float a0 = float_of(hmax(_mm256_max_epi32(abs_bits(v0), abs_bits(v1))));
        const float a1 = float_of(hmax(_mm256_max_epi32(abs_bits(v2), abs_bits(v3))));
        const Nvfp4Block p0 = nvfp4_block(a0, global, engine), p1 = nvfp4_block(a1, global, engine);
        ao[row * kb + b] = a0;
        ao[row * kb + b + 1] = a1;
        so[row * kb + b] = p0.scale;
        so[row * kb + b + 1] = p1.scale;
        const __m256 f0 = _mm256_set1_ps(p0.factor), f1 = _mm256_set1_ps(p1.factor);
        auto scaled = [&](__m256 v, __m256 f) { return clamp8(engine ? _mm256_mul_ps(v, f) : _mm256_div_ps(v, f), kE2m1Max); };
        const __m256i codes = bytes32(e2m1x8(scaled(v0, f0), engine), e2m1x8(scaled(v1, f0), engine),
                                      e2m1x8(scaled(v2, f1), engine), e2m1x8(scaled(v3, f1), engine));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * 8), nibbles16(codes));
      }
#endif
      for (; b < kb; ++b) {
        const uint16_t* blk = in + b * 16;
        uint32_t top = 0;
        for (int j = 0; j < 16; ++j) top = std::max(top, static_cast<uint32_t>(blk[j]) << 16 & 0x7FFFFFFFu);
        const float amax = float_of(top);
        const Nvfp4Block p = nvfp4_block(amax, global, engine);
        ao[row * kb + b] = amax;
        so[row * kb + b] = p.scale;
        for (int j = 0; j < 16; j += 2) {
          const float x0 = bf16(blk[j]), x1 = bf16(blk[j + 1]);
          const uint8_t c0 = e2m1(clamp(engine ? x0 * p.factor : x0 / p.factor, kE2m1Max), engine);
          const uint8_t c1 = e2m1(clamp(engine ? x1 * p.factor : x1 / p.factor, kE2m1Max), engine);
          out[b * 8 + j / 2] = static_cast<uint8_t>(c0 | (c1 << 4));
        }
      }
    }
  });
  return {q, scales, amaxes};
}

// The largest |x| of each matrix of [M, N] bf16 (NVFP4's global scale), as float32 [M].
torch::Tensor amax(torch::Tensor w) {
  check_input(w);
  TORCH_CHECK(w.dim() == 2, "amax takes [M, N]");
  const int64_t m = w.size(0), n = w.size(1);
  auto out = torch::empty({m}, w.options().dtype(torch::kFloat));
  const uint16_t* x = bf16_data(w);
  float* o = out.data_ptr<float>();
  for (int64_t mat = 0; mat < m; ++mat) {
    const uint16_t* base = x + mat * n;
    const int64_t chunk = 1 << 16, chunks = (n + chunk - 1) / chunk;
    std::vector<uint32_t> tops(static_cast<size_t>(chunks), 0);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
        int64_t i = i0;
        uint32_t top = 0;
#if defined(__AVX2__)
        __m256i vmax = _mm256_setzero_si256();
        for (; i + 8 <= i1; i += 8) vmax = _mm256_max_epi32(vmax, abs_bits(load_bf16(base + i)));
        top = hmax(vmax);
#endif
        for (; i < i1; ++i) top = std::max(top, static_cast<uint32_t>(base[i]) << 16 & 0x7FFFFFFFu);
        tops[static_cast<size_t>(c)] = top;
      }
    });
    uint32_t top = 0;
    for (uint32_t t : tops) top = std::max(top, t);
    o[mat] = float_of(top);
  }
  return out;
}

// The element encoders alone, on float32 values, for the tests of every rounding midpoint.
torch::Tensor e4m3_bytes(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous());
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
  const float* in = x.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t count = x.numel();
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 32 <= count; i += 32) {
    __m256i e[4];
    for (int j = 0; j < 4; ++j) e[j] = e4m3x8(clamp8(_mm256_loadu_ps(in + i + 8 * j), kE4m3Max));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), bytes32(e[0], e[1], e[2], e[3]));
  }
#endif
  for (; i < count; ++i) o[i] = e4m3(clamp(in[i], kE4m3Max));
  return out;
}

torch::Tensor e2m1_codes(torch::Tensor x, bool signed_zero) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous());
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
  const float* in = x.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t count = x.numel();
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 32 <= count; i += 32) {
    __m256i e[4];
    for (int j = 0; j < 4; ++j) e[j] = e2m1x8(clamp8(_mm256_loadu_ps(in + i + 8 * j), kE2m1Max), signed_zero);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), bytes32(e[0], e[1], e[2], e[3]));
  }
#endif
  for (; i < count; ++i) o[i] = e2m1(clamp(in[i], kE2m1Max), signed_zero);
  return out;
}

bool vectorized() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_block", &fp8_block, "FP8 block quantization of [M, N, K] bf16 in 128 x 128 blocks");
  m.def("mx", &mx, "MX quantization of [R, K] bf16 in blocks of 32 along K");
  m.def("nvfp4", &nvfp4, "NVFP4 quantization of [M, R, K] bf16 in blocks of 16 along K");
  m.def("amax", &amax, "the largest |x| of each matrix of [M, N] bf16");
  m.def("e4m3_bytes", &e4m3_bytes, "float32 -> float8_e4m3fn bytes, saturating");
  m.def("e2m1_codes", &e2m1_codes, "float32 -> E2M1 codes, saturating");
  m.def("vectorized", &vectorized, "whether the build uses AVX2");
}
