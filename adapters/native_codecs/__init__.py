"""Native codec kernels: C++ (AVX2 where the CPU has it), built once per machine with torch's
extension builder, and installed as the codec path `native` (domain.quant.codecs.compile).

The build needs a C++ compiler (torch.compile's CPU backend needs one too); where there is none,
or the build fails, `install` says why and the codecs keep their other paths. Each native kernel
takes only the calls it ports (bf16 weights, the blocks of its format) and leaves every other to
the compiled path (docs/refit.md#the-codec-path).
"""
