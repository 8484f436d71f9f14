#!/usr/bin/env python3
"""Patch a transformers MoE model with csfmoe, generate, and compare.

Builds a random-initialized model of one supported class (no checkpoint
download), then for the stock model and the model patched with native and
with CSF scales prints prefill and decode tokens/s and the resident bytes of
the routed experts, and checks that greedy generation with the patched model
matches an unpatched copy holding the same dequantized FP4 expert weights
(printing the first divergence and its logit margins otherwise).

  python examples/transformers_generate.py                       # tiny Qwen3-MoE on the CPU
  python examples/transformers_generate.py --family gpt_oss --format mxfp4
  python examples/transformers_generate.py --device cuda --geometry qwen3-30b-a3b --layers 4 --new-tokens 64

On the CPU the experts run csfmoe's float64 reference (slow: keep the model
tiny); on CUDA the fused kernels (gpt-oss's clamped SwiGLU and biases
included)."""

from __future__ import annotations

import argparse
import copy
import time

import torch

from csfmoe.integrations import transformers as integ

# (hidden, moe intermediate, experts, top-k, attention heads, kv heads)
GEOMETRIES = {
    "tiny": (128, 64, 8, 2, 4, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 32, 4),
    "deepseek-v3": (7168, 2048, 256, 8, 128, 128),
    "gpt-oss-20b": (2880, 2880, 32, 4, 64, 8),
}


def build_model(family: str, geometry: str, layers: int, seed: int, device: torch.device):
    with torch.device(device):  # initialized where it runs: fast for real geometries
        return _build_model(family, geometry, layers, seed)


def _build_model(family: str, geometry: str, layers: int, seed: int):
    import transformers as tf

    h, n, e, k, heads, kv = GEOMETRIES[geometry]
    common = dict(vocab_size=1024, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, max_position_embeddings=4096)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=128 if h >= 1024 else 32, intermediate_size=4 * n,
                                moe_intermediate_size=n, num_experts=e, num_experts_per_tok=k, mlp_only_layers=[],
                                decoder_sparse_step=1, norm_topk_prob=True)
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=n, num_local_experts=e, num_experts_per_tok=k)
        return tf.MixtralForCausalLM(cfg)
    if family == "deepseek_v3":
        groups = 8 if e % 8 == 0 and e >= 16 else 2
        # Multi-head latent attention: every head has its own keys and values
        # (transformers would repeat them num_heads / num_key_value_heads times).
        common["num_key_value_heads"] = heads
        cfg = tf.DeepseekV3Config(**common, intermediate_size=4 * n, moe_intermediate_size=n, n_routed_experts=e,
                                  n_shared_experts=1, num_experts_per_tok=k, n_group=groups,
                                  topk_group=max(1, groups // 2), first_k_dense_replace=0,
                                  q_lora_rank=min(1536, 2 * h // 4), kv_lora_rank=min(512, h // 4),
                                  qk_rope_head_dim=64 if h >= 1024 else 16, qk_nope_head_dim=128 if h >= 1024 else 16,
                                  v_head_dim=128 if h >= 1024 else 32, rope_scaling=None)
        return tf.DeepseekV3ForCausalLM(cfg)
    if family == "gpt_oss":
        cfg = tf.GptOssConfig(**common, head_dim=64 if h >= 1024 else 32, intermediate_size=n, num_local_experts=e,
                              num_experts_per_tok=k, sliding_window=128,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2) +
                              ["sliding_attention"] * (layers % 2))
        return tf.GptOssForCausalLM(cfg)
    raise SystemExit(f"unknown family {family!r}")


def give_experts_weight(model, seed: int) -> None:
    """transformers' std-0.02 init leaves the experts nearly silent; give
    them (and the routers) unit-gain weights so that they shape the output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator(device=p.device).manual_seed(seed)
            seed += 1
            if ".experts." in name and p.dim() == 3:
                transposed = type(model).__name__.startswith("GptOss")
                fan_in = p.shape[-2] if transposed else p.shape[-1]
                p.normal_(0.0, fan_in**-0.5, generator=g)
            elif ".experts." in name:
                p.normal_(0.0, 0.1, generator=g)
            elif name.endswith((".gate.weight", ".router.weight")):
                p.normal_(0.0, p.shape[-1]**-0.5, generator=g)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompt, new_tokens, device, static_cache):
    """Greedy generation of `new_tokens` tokens with model.generate, and
    prefill and decode tokens/s timed on a plain loop of cached forwards
    (best of two runs; generate's own overhead left out)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    if static_cache:
        kw["cache_implementation"] = "static"

    def loop():
        sync(device)
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True)
        sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
        sync(device)
        return t1 - t0, time.perf_counter() - t1

    with torch.no_grad():
        loop()  # warm-up: workspaces, kernels, allocator
        times = [loop() for _ in range(2)]
        out = model.generate(prompt, **kw)
    b, p = prompt.shape
    prefill, decode = min(t[0] for t in times), min(t[1] for t in times)
    return out, b * p / prefill, b * (new_tokens - 1) / decode


def first_divergence(a, b, scores_a, scores_b, prompt_len):
    for i in range(prompt_len, a.shape[-1]):
        if a[0, i] != b[0, i]:
            step = i - prompt_len
            la, lb = scores_a[step][0].float(), scores_b[step][0].float()
            top_a, top_b = la.topk(2), lb.topk(2)
            return (f"first divergence at step {step}: patched {int(a[0, i])} (margin "
                    f"{float(top_a.values[0] - top_a.values[1]):.4g}), reference {int(b[0, i])} (margin "
                    f"{float(top_b.values[0] - top_b.values[1]):.4g})")
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
    ap.add_argument("--geometry", default="tiny", choices=sorted(GEOMETRIES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--static-cache", action="store_true", help="generate with transformers' static KV cache")
    ap.add_argument("--expand-ahead", action="store_true",
                    help="CSF run: shared scale scratch, next layer's scales expanded on a side stream (CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (decode speed is measured from the second token on)")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    model = build_model(args.family, args.geometry, args.layers, args.seed, device)
    give_experts_weight(model, args.seed + 1)
    model = model.to(dtype=dtype).eval()
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed + 2)).to(device)
    print(f"{type(model).__name__}: {args.layers} layers, geometry {args.geometry}, {args.format}, {device}, "
          f"{dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens")

    rows = []
    _, pre, dec = timed_generate(model, prompt, args.new_tokens, device, args.static_cache)
    rows.append((f"stock ({str(dtype).replace('torch.', '')} experts)", pre, dec, None))

    # Unpatched copy that will hold the same dequantized FP4 expert weights.
    reference = copy.deepcopy(model)
    results = {}
    for scales in ("native", "csf"):
        t0 = time.perf_counter()
        integ.patch_model(model, format=args.format, scales=scales,
                          expand_ahead=args.expand_ahead and scales == "csf")
        print(f"patched ({scales} scales) in {time.perf_counter() - t0:.1f} s")
        if scales == "native":
            weights = integ.dequantized_expert_weights(model, dtype=dtype)
            reference.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
            del weights
        out, pre, dec = timed_generate(model, prompt, args.new_tokens, device, args.static_cache)
        results[scales] = out
        rows.append((f"csfmoe {args.format}, {scales} scales", pre, dec, integ.expert_memory(model)))
        integ.unpatch_model(model)
    ref_out, pre, dec = timed_generate(reference, prompt, args.new_tokens, device, args.static_cache)
    rows.append((f"reference (dequantized FP4 in {str(dtype).replace('torch.', '')})", pre, dec, None))

    print(f"{'model':44} {'prefill tok/s':>14} {'decode tok/s':>13} {'expert bytes':>13} {'scale bytes':>12}")
    for name, pre, dec, mem in rows:
        mb = f"{mem['total']:>13,}" if mem else f"{'':>13}"
        sb = f"{mem['scales']:>12,}" if mem else f"{'':>12}"
        print(f"{name:44} {pre:>14.1f} {dec:>13.1f} {mb} {sb}")
    mem = rows[-2][3]
    print(f"BF16 experts would take {mem['bf16_equivalent']:,} bytes")

    ok = True
    for scales, out in results.items():
        same = torch.equal(out.sequences, ref_out.sequences)
        ok &= same
        msg = "identical" if same else first_divergence(out.sequences, ref_out.sequences, out.scores,
                                                         ref_out.scores, args.prompt_len)
        print(f"greedy tokens, {scales} scales vs reference: {msg}")
    print("tokens:", results["csf"].sequences[0, args.prompt_len:].tolist())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
