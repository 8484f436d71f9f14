"""csfmoe.integrations.transformers on the CPU: tiny random transformers MoE
models, patched, against the unpatched model given the same dequantized FP4
expert weights."""

import copy

import pytest
import torch

import csfmoe
from docs_example import example

transformers = pytest.importorskip("transformers")
from csfmoe.integrations import transformers as integ  # noqa: E402

VOCAB, HIDDEN, PROMPT, STEPS = 256, 128, 12, 16


def tiny_model(family, seed, moe_intermediate=64):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=256,
                                          moe_intermediate_size=moe_intermediate, num_experts=8,
                                          num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=moe_intermediate, num_local_experts=4,
                                         num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "deepseek_v3":
        # MoE layers with grouped top-k (2 of 4 groups), score correction
        # and a shared expert.
        cfg = transformers.DeepseekV3Config(**common, intermediate_size=256, moe_intermediate_size=moe_intermediate,
                                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                                            topk_group=2, first_k_dense_replace=0, q_lora_rank=64, kv_lora_rank=32,
                                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                                            routed_scaling_factor=2.5, rope_scaling=None)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, head_dim=32, intermediate_size=moe_intermediate,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(cfg)
    else:
        raise AssertionError(family)
    # transformers initializes with std 0.02: the experts would barely move
    # the residual stream. Weights of unit-gain scale make each block's
    # output matter, gpt-oss gates past its clamp limit, and routing uneven.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3:
                fan_in = p.shape[-2] if family == "gpt_oss" else p.shape[-1]
                gain = 3.0 if family == "gpt_oss" and "gate_up" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / fan_in**0.5)
            elif ".experts." in name:  # gpt-oss biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith((".gate.weight", ".router.weight")):
                p.copy_(torch.randn(p.shape, generator=g) / HIDDEN**0.5)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def logits_and_routes(model, prompt):
    """model(prompt)'s logits and, per MoE block in order, the sorted expert
    ids each token went to ([batch, tokens, top-k]), read from what the block
    hands its experts module (the stock one and CsfExperts take the same
    arguments)."""
    routes = []
    blocks = [b for b in model.modules() if type(b).__name__ in integ.SUPPORTED_BLOCKS]
    hooks = [b.experts.register_forward_hook(
        lambda mod, a, kw, out: routes.append((list(a) + list(kw.values()))[1]), with_kwargs=True)
        for b in blocks]
    try:
        logits = model(prompt).logits
    finally:
        for h in hooks:
            h.remove()
    assert len(routes) == len(blocks)
    return logits, [r.sort(dim=-1).values.reshape(*prompt.shape, -1) for r in routes]


def rel_where_routes_agree(model, reference, prompt):
    """Relative difference of the two models' logits over the tokens that
    come before the first routing flip of their sequence, and the number of
    (block, token) pairs whose expert set differs. A flip (two router logits
    within the experts' rounding difference of each other) sends a token to
    other experts, and causal attention carries that into every later token
    of its sequence: those tokens measure the flip, not the kernels. The
    first block's routes cannot differ (its inputs are the same bits in both
    models), and the flips must be few (a quarter of the tokens at most). A
    wrong expert output still shows: the first block's experts run on every
    token before any flip can happen."""
    got, got_routes = logits_and_routes(model, prompt)
    want, want_routes = logits_and_routes(reference, prompt)
    same = [(a == b).all(-1) for a, b in zip(got_routes, want_routes)]
    assert bool(same[0].all()), "the first MoE block routed identical inputs differently"
    flips = sum(int((~s).sum()) for s in same)
    assert flips <= prompt.numel() // 4, f"{flips} routing flips over {prompt.numel()} tokens"
    before_flip = torch.stack(same).all(0).int().cumprod(-1).bool()
    assert bool(before_flip.any()), "every sequence flips at its first token"
    return rel(got[before_flip], want[before_flip]), flips, got


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE",
          "gpt_oss": "GptOssMLP"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt,scales", [("nvfp4", "csf"), ("mxfp4", "native")])
def test_patched_model_matches_dequantized_reference(seed, family, fmt, scales):
    model = tiny_model(family, seed)
    g = torch.Generator().manual_seed(seed + 2)
    prompt = torch.randint(0, VOCAB, (2, PROMPT), generator=g)
    with torch.no_grad():
        bf16_logits = model(prompt).logits
        reference = copy.deepcopy(model)
        assert integ.patch_model(model, format=fmt, scales=scales) is model
        patched = [m for m in model.modules() if isinstance(m, integ.CsfExperts)]
        assert len(patched) == 2 and all(type(b).__name__ == BLOCKS[family] for b in model.modules()
                                         if isinstance(getattr(b, "experts", None), integ.CsfExperts))
        assert all(m.format == fmt and m.scales == scales for m in patched)
        loaded = reference.load_state_dict(integ.dequantized_expert_weights(model), strict=False)
        assert not loaded.unexpected_keys
        err, _, got = rel_where_routes_agree(model, reference, prompt)
        assert err < 1e-2
        # The FP4 experts move the logits far beyond that tolerance: the
        # comparison above sees the experts.
        assert rel(got, bf16_logits) > 10 * max(err, 1e-4)
        out = model.generate(prompt[:1], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        ref = reference.generate(prompt[:1], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    assert out.shape[1] == PROMPT + STEPS
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores_outputs_bit_identical(seed, family):
    model = tiny_model(family, seed)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    originals = {n: m for n, m in model.named_modules() if n.endswith(".experts")}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        before = model(prompt).logits
        integ.patch_model(model)
        assert integ.is_patched(model)
        patched = model(prompt).logits
        assert not torch.equal(patched, before)
        integ.unpatch_model(model)
        after = model(prompt).logits
    assert not integ.is_patched(model)
    assert torch.equal(after, before)
    assert {n: m for n, m in model.named_modules() if n.endswith(".experts")} == originals
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    integ.patch_model(model, format="mxfp4", scales="native")  # patchable again
    assert integ.is_patched(model)


def test_already_patched_is_refused(seed):
    model = tiny_model("qwen3_moe", seed)
    integ.patch_model(model)
    experts = [m for m in model.modules() if isinstance(m, integ.CsfExperts)]
    with pytest.raises(csfmoe.InvalidArgument, match="already patched"):
        integ.patch_model(model)
    assert [m for m in model.modules() if isinstance(m, integ.CsfExperts)] == experts
    # A copy of a patched model's block inside another model is caught too.
    outer = torch.nn.Sequential(model.model.layers[0])
    with pytest.raises(csfmoe.InvalidArgument, match="already patched"):
        integ.patch_model(outer)


def test_unpatch_of_unpatched_model_is_refused(seed):
    with pytest.raises(csfmoe.InvalidArgument, match="not patched"):
        integ.unpatch_model(tiny_model("mixtral", seed))
    with pytest.raises(csfmoe.InvalidArgument, match="not patched"):
        integ.expert_memory(tiny_model("mixtral", seed))


def test_model_without_supported_block_is_refused(seed):
    torch.manual_seed(seed)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(csfmoe.Unsupported, match="LlamaForCausalLM has no sparse-MoE block"):
        integ.patch_model(dense)
    olmoe = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_experts=4, num_experts_per_tok=2))
    with pytest.raises(csfmoe.Unsupported, match="OlmoeSparseMoeBlock"):
        integ.patch_model(olmoe)
    with pytest.raises(csfmoe.InvalidArgument, match="torch.nn.Module"):
        integ.patch_model("model")
    assert not integ.is_patched(dense) and not integ.is_patched(olmoe)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_shapes_the_kernels_cannot_run(seed, family):
    # N = 96: a multiple of both group sizes (the quantizer takes it), not of
    # the kernels' 64 tile.
    model = tiny_model(family, seed, moe_intermediate=96)
    with pytest.raises(csfmoe.InvalidArgument, match=r"cannot run these experts.*intermediate = 96"):
        integ.patch_model(model)
    assert not integ.is_patched(model)
    assert not any(isinstance(m, integ.CsfExperts) for m in model.modules())


def test_failure_in_a_later_block_changes_nothing(seed):
    model = tiny_model("qwen3_moe", seed)
    model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    first = model.model.layers[0].mlp.experts
    with pytest.raises(csfmoe.Unsupported, match=r"layers\.1\.mlp\.experts.*not SiLU"):
        integ.patch_model(model)
    assert model.model.layers[0].mlp.experts is first
    assert not integ.is_patched(model)


def test_bad_options_are_refused(seed):
    model = tiny_model("mixtral", seed)
    with pytest.raises(csfmoe.InvalidArgument, match="format"):
        integ.patch_model(model, format="fp8")
    with pytest.raises(csfmoe.InvalidArgument, match="scales"):
        integ.patch_model(model, scales="zip")
    with pytest.raises(csfmoe.InvalidArgument, match="expand_ahead needs scales='csf'"):
        integ.patch_model(model, scales="native", expand_ahead=True)
    with pytest.raises(csfmoe.InvalidArgument, match="expand_ahead needs all MoE blocks on one CUDA device"):
        integ.patch_model(model, expand_ahead=True)
    assert not integ.is_patched(model)


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "nvfp4"), ("qwen3_moe", "mxfp4"), ("gpt_oss", "mxfp4"),
                                        ("gpt_oss", "nvfp4")])
def test_bf16_cpu_path_is_the_library_reference(seed, family, fmt):
    """bf16 hidden states on the CPU run csfmoe.moe_reference (C++, float64;
    gpt-oss with its activation and biases); the float64 PyTorch path on the
    same bf16 inputs agrees to bf16 rounding."""
    model = tiny_model(family, seed)
    integ.patch_model(model, format=fmt)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(seed)
    t = 9
    x = (torch.randn(t, HIDDEN, generator=g) * 2).to(torch.bfloat16)
    e = experts.num_experts
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    w = torch.softmax(torch.randn(t, 2, generator=g), 1)
    got = experts(x, ids, w)
    want = experts._reference(x, ids, w)
    assert got.dtype == torch.bfloat16
    assert rel(got, want) < 4e-3


def test_expert_memory_counts_fp4_bytes(seed):
    h, n, e, layers = HIDDEN, 64, 8, 2
    native = integ.patch_model(tiny_model("qwen3_moe", seed), scales="native")
    csf = integ.patch_model(tiny_model("qwen3_moe", seed), scales="csf")
    mem_native, mem_csf = integ.expert_memory(native), integ.expert_memory(csf)
    assert mem_native["weights"] == mem_csf["weights"] == layers * e * 3 * h * n // 2
    assert mem_native["scales"] == layers * e * 3 * h * n // 16
    want = sum(m.layer.w13_scale.nbytes + m.layer.w2_scale.nbytes for m in csf.modules()
               if isinstance(m, integ.CsfExperts))
    assert mem_csf["scales"] == want
    assert mem_native["scratch"] == mem_csf["scratch"] == 0  # CPU layers decode, they keep no device scratch
    assert mem_csf["total"] == mem_csf["weights"] + mem_csf["scales"] + mem_csf["globals"]
    assert mem_native["bf16_equivalent"] == layers * e * 3 * h * n * 2


def test_csf_and_native_scales_give_the_same_outputs(seed):
    native = integ.patch_model(tiny_model("deepseek_v3", seed), scales="native")
    csf = integ.patch_model(tiny_model("deepseek_v3", seed), scales="csf")
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(native(prompt).logits, csf(prompt).logits)


def test_docs_example_runs_as_written(capsys):
    exec(compile(example("transformers"), "docs/python.md:transformers", "exec"), {})
    assert "bf16_equivalent" in capsys.readouterr().out


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_exact(shape, g):
    """[E, R, K] values that MXFP4 quantizes without loss: E2M1 values times
    a power of two per 32-block, each block holding a +-6 (its amax)."""
    e, r, k = shape
    codes = E2M1[torch.randint(0, 8, (e, r, k), generator=g)]
    codes = codes * (torch.randint(0, 2, (e, r, k), generator=g) * 2 - 1)
    blocks = codes.view(e, r, k // 32, 32)
    at = torch.randint(0, 32, (e, r, k // 32, 1), generator=g)
    blocks.scatter_(-1, at, 6.0 * (torch.randint(0, 2, (e, r, k // 32, 1), generator=g) * 2 - 1))
    exponent = torch.randint(-9, -4, (e, r, k // 32, 1), generator=g).float()
    return (blocks * torch.pow(2.0, exponent)).view(e, r, k)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp4_exact_experts_reproduce_the_original_model(seed, family):
    """Expert weights that MXFP4 represents exactly: the patched model must
    compute what the original model computes, which checks each class's
    layout (gate/up order, gpt-oss's transposes and interleaved rows, biases)
    against transformers' own expert code, not against our reference."""
    model = tiny_model(family, seed)
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3:
                if family == "gpt_oss":  # [E, K, R]: x @ W
                    p.copy_(mxfp4_exact((p.shape[0], p.shape[2], p.shape[1]), g).transpose(1, 2))
                else:
                    p.copy_(mxfp4_exact(tuple(p.shape), g))
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    prompt = torch.randint(0, VOCAB, (2, PROMPT), generator=g)
    with torch.no_grad():
        want = model(prompt).logits
        ref = model.generate(prompt[:1], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        integ.patch_model(model, format="mxfp4", scales="csf")
        deq = integ.dequantized_expert_weights(model)
        assert deq.keys() == originals.keys()
        for n, w in originals.items():
            assert torch.equal(deq[n], w), n
        got = model(prompt).logits
        out = model.generate(prompt[:1], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    assert rel(got, want) < 1e-5
    assert torch.equal(out, ref)


def test_failure_while_building_a_later_block_restores_the_earlier_ones(seed, monkeypatch):
    model = tiny_model("mixtral", seed)
    originals = [layer.mlp.experts for layer in model.model.layers]
    calls = []

    def quantize_failing_on_layer_1(weights, format):
        calls.append(tuple(weights.shape))
        if len(calls) == 3:  # layer 0 took two calls (w13, w2): it is already in place
            raise MemoryError("out of memory (injected)")
        return csfmoe.quantize(weights, format)

    monkeypatch.setattr(integ, "quantize", quantize_failing_on_layer_1)
    with pytest.raises(MemoryError, match="injected"):
        integ.patch_model(model)
    assert len(calls) == 3
    assert [layer.mlp.experts for layer in model.model.layers] == originals
    assert not integ.is_patched(model)


def checkpoint_layers(model, fmt, csf_scales):
    """FP4 tensors of each MoE block as csfmoe.checkpoint.gather_moe_layer
    returns them, quantized here from the model's own expert weights."""
    layers = {}
    for name, module in model.named_modules():
        if type(module).__name__ in integ.SUPPORTED_BLOCKS:
            q13 = csfmoe.quantize(module.experts.gate_up_proj, fmt)
            q2 = csfmoe.quantize(module.experts.down_proj, fmt)
            sdt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
            s13, s2 = q13["scales"].view(sdt), q2["scales"].view(sdt)
            if csf_scales:
                s13, s2 = csfmoe.CsfScales.compress(s13, fmt), csfmoe.CsfScales.compress(s2, fmt)
            layers[name] = {"format": fmt, "w13": q13["packed"], "w2": q2["packed"], "w13_scale": s13,
                            "w2_scale": s2, "w13_global": q13["global"], "w2_global": q2["global"]}
    return layers


@pytest.mark.parametrize("fmt,csf_scales", [("nvfp4", True), ("mxfp4", False)])
def test_fp4_tensors_given_instead_of_quantizing(seed, fmt, csf_scales):
    quantizing = integ.patch_model(tiny_model("deepseek_v3", seed), format=fmt)
    model = tiny_model("deepseek_v3", seed)
    layers = checkpoint_layers(model, fmt, csf_scales)
    # The block's BF16 experts are not needed: the model may hold them on the meta device.
    for name in layers:
        model.get_submodule(name).experts.to("meta")
    integ.patch_model(model, format=fmt, quantized=layers, device="cpu")
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, quantizing(prompt).logits)
    integ.unpatch_model(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"


def test_fp4_tensors_are_checked(seed):
    model = tiny_model("qwen3_moe", seed)
    layers = checkpoint_layers(model, "nvfp4", False)
    with pytest.raises(csfmoe.InvalidArgument, match=r"\['model\.layers\.7\.mlp'\], which are not MoE blocks"):
        integ.patch_model(model, quantized={"model.layers.7.mlp": layers["model.layers.0.mlp"]})
    with pytest.raises(csfmoe.InvalidArgument, match="is nvfp4, the patch asks for mxfp4"):
        integ.patch_model(model, format="mxfp4", quantized=layers)
    bad = dict(layers["model.layers.1.mlp"], w2=layers["model.layers.1.mlp"]["w2"][:, :, :-1].contiguous())
    with pytest.raises(csfmoe.InvalidArgument,
                       match=r"quantized\['model\.layers\.1\.mlp'\]\['w2'\]: expected shape \[8, 128, 32\]"):
        integ.patch_model(model, quantized={**layers, "model.layers.1.mlp": bad})
    assert not integ.is_patched(model)
    assert not any(isinstance(m, integ.CsfExperts) for m in model.modules())
    model.model.layers[0].mlp.experts.to("meta")
    with pytest.raises(csfmoe.InvalidArgument, match="meta device"):
        integ.patch_model(model)
    oss = tiny_model("gpt_oss", seed)
    with pytest.raises(csfmoe.Unsupported, match="SiLU blocks only"):
        integ.patch_model(oss, quantized={"model.layers.0.mlp": {}})


def test_save_pretrained_of_a_patched_model_is_refused(seed, tmp_path):
    """transformers would save no routed experts (CsfExperts holds no
    parameters) and a reload would fill them at random: refused while
    patched, nothing written; unpatched, the model saves and reloads."""
    model = tiny_model("qwen3_moe", seed)
    integ.patch_model(model)
    with pytest.raises(csfmoe.Unsupported, match="unpatch_model") as e:
        model.save_pretrained(tmp_path / "patched")
    assert "routed experts" in str(e.value)
    assert not (tmp_path / "patched").exists() or not any((tmp_path / "patched").iterdir())
    integ.unpatch_model(model)
    model.save_pretrained(tmp_path / "plain")
    back = type(model).from_pretrained(tmp_path / "plain").eval()
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(back(prompt).logits, model(prompt).logits)


def test_patch_errors_name_the_layer_device_and_key(seed):
    # device="cuda" where csfmoe cannot run CUDA: the package's error, naming the block.
    if not (csfmoe.has_cuda and torch.cuda.is_available()):
        model = tiny_model("qwen3_moe", seed)
        with pytest.raises(csfmoe.Error) as e:
            integ.patch_model(model, device="cuda")
        assert "model.layers.0.mlp.experts" in str(e.value) and "device cuda" in str(e.value)
        assert not integ.is_patched(model)
    # A NaN in one expert's weights: the block, the tensor and the expert are named.
    model = tiny_model("mixtral", seed)
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(0, 4, (1,), generator=g))
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[e, int(torch.randint(0, HIDDEN, (1,), generator=g)), 0] = \
            float("nan")
    with pytest.raises(csfmoe.InvalidArgument) as err:
        integ.patch_model(model)
    assert f"model.layers.1.mlp.experts.down_proj (expert {e})" in str(err.value), str(err.value)
    assert "NaN" in str(err.value)
    assert not integ.is_patched(model)
    # A non-finite global scale among the given FP4 tensors: the key and the entry.
    model = tiny_model("qwen3_moe", seed)
    layers = checkpoint_layers(model, "nvfp4", False)
    bad = dict(layers["model.layers.1.mlp"])
    bad["w13_global"] = bad["w13_global"].clone()
    bad["w13_global"][e] = float("inf")
    with pytest.raises(csfmoe.InvalidArgument) as err:
        integ.patch_model(model, quantized={**layers, "model.layers.1.mlp": bad})
    assert f"quantized['model.layers.1.mlp']['w13_global'][{e}] is inf" in str(err.value), str(err.value)
    assert not integ.is_patched(model)
