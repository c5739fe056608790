"""Checkpoint policies: bit-equal gradients (fp32, dropout on), exact recomputed FLOPs, less memory."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.apply.checkpoint import applied, find_blocks, remove
from memfit.core.tracker import MemoryTracker
from memfit.models.gpt import GPT, GPTConfig

POLICIES = [
    "full", "every:2", "sqrt", "selective",
    "keep,selective,recompute,recompute",
    "recompute+seg=0*3,selective",
    "none+offload:cpu", "none+offload:disk", "full+offload:cpu", "full+offload:disk", "sqrt+offload:disk",
    "selective+offload:disk", "keep+offload:disk,recompute+offload:cpu,selective+offload:cpu,recompute",
]


def tiny(arch="gpt2", dropout=0.1, layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=layers, hidden=32, heads=4, kv_heads=2 if arch == "llama" else None,
                         vocab=64, seq=16, dropout=dropout, arch=arch))


def step(model, policy, autocast=False, micro=2, **kw):
    """Gradient accumulation over `micro` micro-batches; returns grads, last loss, next random number."""
    memfit.checkpoint(model, policy, **kw)
    torch.manual_seed(1)
    xs = [torch.randint(0, 64, (2, 16)) for _ in range(micro)]
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss, _ = model(x, x)
        loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, loss.item(), torch.rand(1).item()


def assert_same(a, b):
    ga, la, ra = a
    gb, lb, rb = b
    assert la == lb
    assert ra == rb, "the RNG state after the step must not depend on the policy"
    for k in ga:
        assert torch.equal(ga[k], gb[k]), f"grad of {k} differs"


CASES = [(p, "gpt2") for p in POLICIES] + [
    (p, "llama") for p in ("full", "sqrt", "selective", "none+offload:disk", "recompute+seg=0*3,selective")
] + [pytest.param(p, "llama", marks=pytest.mark.slow) for p in POLICIES[1:]]


@pytest.mark.parametrize("policy, arch", CASES)
def test_bit_equal_grads_fp32_with_dropout_and_accumulation(policy, arch, tmp_path):
    ref = step(tiny(arch), "none")
    assert_same(step(tiny(arch), policy, spill_dir=str(tmp_path)), ref)


@pytest.mark.parametrize("policy", ["full", "selective", "sqrt+offload:cpu"])
def test_bit_equal_under_autocast(policy, tmp_path):
    ref = step(tiny("llama"), "none", autocast=True)
    assert_same(step(tiny("llama"), policy, autocast=True, spill_dir=str(tmp_path)), ref)


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                       max_position_embeddings=16, attention_dropout=0.1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def hf_step(model, policy, **kw):
    memfit.checkpoint(model, policy, **kw)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 16))
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, loss.item(), torch.rand(1).item()


@pytest.mark.parametrize("kind, policy", [
    ("gpt2", "full"), ("gpt2", "sqrt"), ("gpt2", "selective+offload:disk"),
    ("llama", "full+offload:disk"), ("llama", "selective"), ("llama", "keep+offload:cpu"),
])
def test_hugging_face_models_bit_equal(kind, policy, tmp_path):
    model = _hf(kind)
    assert find_blocks(model) is (model.transformer.h if kind == "gpt2" else model.model.layers)
    ref = hf_step(_hf(kind), "none")
    assert_same(hf_step(model, policy, spill_dir=str(tmp_path)), ref)


def test_wrapper_leaves_the_kv_cache_on_as_torchs_checkpoint_wrapper_does():
    """`wrapper` is torch's checkpoint_wrapper per block: the cache stays on (full switches it off, as
    Hugging Face's own checkpointing does), and the step is bit-equal to the plain one and to torch's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def run(model):
        torch.manual_seed(1)
        x = torch.randint(0, 64, (2, 16))
        model(input_ids=x, labels=x).loss.backward()  # the config's use_cache: on
        return {k.replace("._checkpoint_wrapped_module", ""): p.grad for k, p in model.named_parameters()}

    ref, wrapped, torchs = _hf("llama"), _hf("llama"), _hf("llama")
    memfit.checkpoint(wrapped, "wrapper")
    assert wrapped.config.use_cache and not memfit.checkpoint(_hf("llama"), "full").config.use_cache
    for i, layer in enumerate(torchs.model.layers):
        torchs.model.layers[i] = checkpoint_wrapper(layer)
    want = run(ref)
    for got in (run(wrapped), run(torchs)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_state_dict_keys_unchanged_and_policy_replaceable():
    model = tiny()
    keys = list(model.state_dict())
    memfit.checkpoint(model, "full")
    assert list(model.state_dict()) == keys
    assert [str(a) for a in applied(model).actions] == ["recompute"] * 4
    memfit.checkpoint(model, "keep,keep,selective,keep")
    assert [a.mode for a in applied(model).actions] == ["keep", "keep", "selective", "keep"]
    assert "forward" not in model.blocks[0].__dict__ and "forward" in model.blocks[2].__dict__
    memfit.checkpoint(model, "none")
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert list(model.state_dict()) == keys
    memfit.checkpoint(model, "sqrt")
    remove(model)
    assert applied(model) is None and all("forward" not in b.__dict__ for b in model.blocks)


def test_explicit_blocks_and_missing_blocks():
    inner = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.stack = inner
    memfit.checkpoint(model, "full", blocks=inner)
    assert applied(model, inner) is not None
    with pytest.raises(memfit.ConfigError, match="pass blocks="):
        find_blocks(torch.nn.Linear(2, 2))


def test_exception_inside_a_segment_leaves_no_hooks_behind(tmp_path):
    model = tiny()
    memfit.checkpoint(model, "recompute+seg=0*2,recompute+seg=1*2")

    def boom(x):
        raise RuntimeError("boom")

    model.blocks[1].attn.forward = boom  # the second block of segment 0 fails mid-segment
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randint(0, 64, (2, 16)))
    del model.blocks[1].attn.forward
    # the failed forward must not leave saved-tensor hooks or dispatch modes pushed
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert_same(step(model, "recompute+seg=0*2,recompute+seg=1*2"), step(tiny(), "none"))


# ---- recomputation FLOPs ----------------------------------------------------------------------

def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_recomputed_forward_flops_match_each_policy(arch):
    """Backward recomputes exactly what each policy drops (FlopCounterMode counts matmul/attention FLOPs).

    Recomputation stops as soon as backward has what it needs (non-reentrant early stop), which is
    before a segment's last matmul (the MLP down projection) runs: so a recomputed block costs one
    block forward minus that matmul, and selective recomputes only the attention output projection.
    """
    L, x = 4, torch.randint(0, 64, (2, 16))
    model = tiny(arch, dropout=0.0, layers=L)
    h = torch.randn(2, 16, 32)
    block = _flops(lambda: model.blocks[0](h))
    down = _flops(lambda: model.blocks[0].mlp.proj(torch.randn(2, 16, model.cfg.ffn)))
    attn_out = _flops(lambda: model.blocks[0].attn.proj(h))
    q = torch.randn(2, 4, 16, 8)
    attn_out += _flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))

    def total(policy):
        m = tiny(arch, dropout=0.0, layers=L)
        memfit.checkpoint(m, policy)
        return _flops(lambda: m(x, x)[1].backward())

    base = total("none")
    expected = {
        "full": L * (block - down),
        "every:2": 2 * (block - down),
        "sqrt": 2 * (2 * block - down),  # two segments of two blocks
        "recompute+seg=0*4": 4 * block - down,
        "selective": L * attn_out,
        "keep,selective,keep,recompute": attn_out + block - down,
        "full+offload:cpu+compress:int8": L * (block - down),
        "none+offload:cpu": 0,
    }
    for policy, extra in expected.items():
        assert total(policy) - base == extra, policy


# ---- memory ----------------------------------------------------------------------------------

def block_memory(policy, tmp_path, arch="gpt2"):
    """Device bytes the blocks keep alive after their forward (tracker), and the tracker itself."""
    model = tiny(arch, dropout=0.0, layers=4)
    memfit.checkpoint(model, policy, spill_dir=str(tmp_path))
    marks = {}
    with MemoryTracker(model) as tr:
        # (hooks return None: a forward pre-hook's return value would replace the block's input)
        model.blocks[0].register_forward_pre_hook(lambda m, a: None if marks.setdefault("start", tr.current_bytes) else None)
        model.blocks[-1].register_forward_hook(lambda m, a, o: None if marks.setdefault("end", tr.current_bytes) else None)
        _, loss, _ = model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
        loss.backward()
    return marks["end"] - marks["start"], tr


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_activation_memory_measured_lower(arch, tmp_path):
    none, _ = block_memory("none", tmp_path, arch)
    got = {p: block_memory(p, tmp_path, arch)[0] for p in
           ("full", "sqrt", "selective", "none+offload:cpu", "none+offload:disk", "none+compress:int8", "full+offload:cpu")}
    assert got["full"] < 0.3 * none  # only each block's input (and the last output) stay
    assert got["sqrt"] < got["full"]  # fewer inputs kept: two per model instead of four
    assert got["full"] < got["selective"] < 0.75 * none
    assert got["none+offload:cpu"] < 0.3 * none
    assert got["none+compress:int8"] < 0.5 * none
    assert got["full+offload:cpu"] < got["full"]
    # disk writes run in the background; the saved tensors are released once written
    assert got["none+offload:disk"] <= none


def test_cpu_offload_counts_host_bytes_not_device_bytes(tmp_path):
    _, plain = block_memory("none", tmp_path)
    _, off = block_memory("none+offload:cpu", tmp_path)
    assert plain.host_peak_bytes == 0
    assert off.host_peak_bytes > 0
    assert off.peak_bytes < plain.peak_bytes


def test_offload_references_stay_bounded_over_steps():
    """The store's per-block references to offloaded tensors do not grow with the number of steps."""
    model = tiny(dropout=0.0, layers=3)
    memfit.checkpoint(model, "none+offload:cpu")
    store = applied(model).store
    sizes = []
    for _ in range(4):
        x = torch.randint(0, 64, (2, 16))
        model(x, x)[1].backward()
        sizes.append(sum(len(refs) for refs in store._groups.values()))
    assert sizes[-1] == sizes[1] > 0


# ---- CUDA (skipped without a GPU) ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("policy", ["full", "selective", "sqrt", "every:2", "keep*1,recompute+seg=2*2,selective*1",
                                    "full+offload:cpu", "none+offload:cpu", "none+offload:disk",
                                    "full+offload:disk"])
def test_cuda_bit_equal_with_dropout(policy, autocast, tmp_path):
    """CUDA generator restored on recompute; pinned side-stream offload and read-ahead give exact values."""
    def run(p):
        torch.manual_seed(0)
        m = GPT(GPTConfig(layers=4, hidden=64, heads=4, vocab=64, seq=32, dropout=0.1)).cuda()
        memfit.checkpoint(m, p, spill_dir=str(tmp_path))
        torch.manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 64, (2, 32), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = m(x, x)[1]
            loss.backward()
        return {k: v.grad.clone() for k, v in m.named_parameters()}, torch.rand(1, device="cuda").item()

    ref, r_ref = run("none")
    got, r_got = run(policy)
    assert r_ref == r_got
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.gpu
def test_cuda_pinned_side_stream_prefetch_bit_equal(monkeypatch):
    """Offload with pinned host buffers and side-stream copies: every earlier block is prefetched
    while backward runs the next, the prefetched copies are the ones used, gradients are bit-equal."""
    from memfit.apply import saved_copies

    counts = {"prefetch": 0, "used": 0}
    prefetch, get = saved_copies.HostCopy.prefetch, saved_copies.HostCopy.get

    def counting_prefetch(self):
        counts["prefetch"] += self.prefetched is None and self.ready is not None
        prefetch(self)

    def counting_get(self):
        counts["used"] += self.prefetched is not None
        return get(self)

    monkeypatch.setattr(saved_copies.HostCopy, "prefetch", counting_prefetch)
    monkeypatch.setattr(saved_copies.HostCopy, "get", counting_get)

    def run(policy):
        torch.manual_seed(0)
        m = GPT(GPTConfig(layers=4, hidden=256, heads=4, vocab=512, seq=256, dropout=0.1)).cuda()
        memfit.checkpoint(m, policy)
        torch.manual_seed(1)
        x = torch.randint(0, 512, (8, 256), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, x)[1]
        loss.backward()
        torch.cuda.synchronize()
        state = applied(m)
        return {k: v.grad.clone() for k, v in m.named_parameters()}, state.store.stats if state else None

    ref, _ = run("none")
    got, stats = run("none+offload:cpu")
    assert stats.pinned is True and stats.host_bytes > 0
    assert counts["prefetch"] > 0 and counts["used"] > 0
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
