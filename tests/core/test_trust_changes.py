"""A model that changed since capture: noticed at call time, recaptured or refused; weights
updated in place are seen by replays, as by eager; graphcap never writes a caller's
tensor. On the emulator in CI and on CUDA graphs (where a replay over freed weights read
garbage) on the GPU."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import BadBatch, ModelChanged
from graphcap.models import PRESETS, Decoder
from tests.support.runner_helpers import DEVICE, batch, tolerance

ATTN = "torch_masked"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def fresh_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    args = dataclasses.replace(PRESETS["tiny"], head_dim=64) if DEVICE == "cuda" \
        else PRESETS["tiny"]
    with torch.device(DEVICE):
        m = Decoder(args)
    return m.to(torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()


def capture(m, strategy, **kw):
    return graphcap.capture(m, strategy, buckets=[8, 16], max_requests=2, attention=ATTN,
                            **kw)


def assert_matches_eager(r, m, lens=(5, 3), seed=0):
    ids, pos = batch(list(lens), seed=seed)
    with torch.inference_mode(), graphcap.packed(list(lens), DEVICE, ATTN):
        want = m(ids, pos)  # eager, on the runner's attention backend
    atol, rtol = tolerance()
    torch.testing.assert_close(r(ids, pos, seq_lens=list(lens)), want, atol=atol, rtol=rtol)


def like(t):
    """New values of ``t``'s shape and spread."""
    return torch.randn_like(t) * t.float().std().clamp(min=1e-3).to(t.dtype)


def reassign(m):
    m.lm_head.weight = torch.nn.Parameter(like(m.lm_head.weight))


def load_assign(m):
    m.load_state_dict({k: like(v) for k, v in m.state_dict().items()}, assign=True)


def swap_data(m):
    w = m.blocks[0].attn.qkv.weight
    w.data = like(w)


def swap_tensors(m):
    w = m.blocks[1].mlp.down.weight
    try:
        torch.utils.swap_tensors(w, torch.nn.Parameter(like(w)))
    except RuntimeError as exc:  # a compiled forward's guards hold a weakref to it
        pytest.skip(f"torch refuses the swap itself: {exc}")


def to_half(m):
    m.to(torch.float16 if DEVICE == "cuda" else torch.bfloat16)


def replace_block(m):
    m.blocks[1] = Decoder(m.args).blocks[0].to(DEVICE, m.norm.dtype)


def insert_block(m):  # no registration hook runs: ModuleList writes its dict itself
    m.blocks.insert(1, Decoder(m.args).blocks[0].to(DEVICE, m.norm.dtype))


def delete_block(m):  # ModuleList builds a new dict of the blocks left
    del m.blocks[0]


CHANGES = {"reassigned parameter": (reassign, "lm_head.weight: another tensor"),
           "load_state_dict(assign=True)": (load_assign, "another tensor"),
           "p.data = ...": (swap_data, "blocks.0.attn.qkv.weight: its storage moved"),
           "torch.utils.swap_tensors": (swap_tensors,
                                        "blocks.1.mlp.down.weight: its storage moved"),
           "model.to(dtype)": (to_half, "its storage moved"),
           "replaced submodule": (replace_block, "blocks.1: another module"),
           "ModuleList.insert": (insert_block, r"blocks: ModuleList edited \(3 entries, 2"),
           "del ModuleList[i]": (delete_block, r"blocks: ModuleList edited \(1 entries, 2"),
           "model.train()": (lambda m: m.train(), r"training: True \(False at capture")}


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_model_changed_after_capture_is_recaptured_at_the_next_call(strategy, change):
    m = fresh_model()
    r = capture(m, strategy)
    assert_matches_eager(r, m)
    CHANGES[change][0](m)
    assert_matches_eager(r, m, seed=1)  # eager's result, not the capture's weights
    assert_matches_eager(r, m, lens=(16,), seed=2)
    assert r.report()["recaptures"] == 1 and sum(r.stats.replays.values()) == 3


def test_tc_piecewise_compiles_with_every_tensor_guarded(monkeypatch):
    """torch 2.11's Dynamo skips the tensor guards of parameters whose module dict is
    unchanged, as ``model.to(dtype)`` leaves it: the next call ran the code traced at the
    old dtype (an attention output of the old dtype, where no float buffer changed with
    the parameters). graphcap's compiles run with that skip off; other compiles keep it."""
    from graphcap.piecewise.compiler import PiecewiseCompiler

    config, seen, stock = torch._dynamo.config, [], PiecewiseCompiler.__call__

    def spy(self, gm, example_inputs):
        seen.append(config.skip_tensor_guards_with_matching_dict_tags)
        return stock(self, gm, example_inputs)

    monkeypatch.setattr(PiecewiseCompiler, "__call__", spy)
    before = config.skip_tensor_guards_with_matching_dict_tags
    m = fresh_model()
    r = capture(m, "tc_piecewise")
    assert_matches_eager(r, m)
    to_half(m)
    assert_matches_eager(r, m, seed=1)
    assert len(seen) >= 2 and not any(seen), seen  # compiled again at the new dtype
    assert config.skip_tensor_guards_with_matching_dict_tags == before


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_on_change_error_names_what_changed_and_recapture_clears_it(strategy, change):
    m = fresh_model()
    r = capture(m, strategy, on_change="error")
    assert_matches_eager(r, m)
    make, needle = CHANGES[change]
    make(m)
    with pytest.raises(ModelChanged, match=needle) as info:
        assert_matches_eager(r, m)
    assert "runner.recapture()" in str(info.value) and info.value.changes
    assert r.report()["failed"] == 1
    r.recapture()
    assert_matches_eager(r, m, seed=3)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_weights_updated_in_place_are_seen_by_replays_without_a_recapture(strategy):
    m = fresh_model()
    r = capture(m, strategy)
    assert_matches_eager(r, m)
    other = fresh_model(seed=1)
    with torch.no_grad():
        for p, q in zip(m.parameters(), other.parameters(), strict=True):
            p.copy_(q)
    assert_matches_eager(r, m, seed=1)
    m.load_state_dict(fresh_model(seed=2).state_dict())  # copies into the same tensors
    assert_matches_eager(r, m, seed=2)
    assert r.report()["recaptures"] == 0


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_replaced_weight_keeps_the_old_tensor_untouched(strategy):
    m = fresh_model()
    r = capture(m, strategy)
    assert_matches_eager(r, m)
    old = m.lm_head.weight
    kept = old.detach().clone()
    reassign(m)
    assert_matches_eager(r, m, seed=1)
    assert torch.equal(old, kept)  # the caller's tensor: never written


def test_modules_built_elsewhere_after_capture_change_nothing():
    # Registrations anywhere in the process make the runner look at every slot again.
    m = fresh_model()
    r = capture(m, "full")
    assert_matches_eager(r, m)
    fresh_model(seed=1)  # another model: thousands of registrations
    assert_matches_eager(r, m, seed=1)
    assert r.report()["recaptures"] == 0


class _Slicing(torch.nn.Module):
    """Builds a module in its forward, as transformers' ``self.layers[:n]`` does."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_a_users_torch_compile_is_not_recompiled_by_graphcaps_registration_hooks():
    # The hooks counting registrations run while Dynamo traces a forward that builds a
    # ModuleList; a count read there would be guarded on and change on every call.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_Slicing(), backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        for _ in range(4):
            compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    m = fresh_model()  # registrations outside compiled code are still seen
    r = capture(m, "full")
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() * 2)
    assert_matches_eager(r, m)
    assert r.report()["recaptures"] == 1


def test_a_model_moved_to_another_device_is_refused():
    m = fresh_model()
    r = capture(m, "full")
    assert_matches_eager(r, m)
    m.to("meta")
    ids, pos = batch([5, 3])
    with pytest.raises(ModelChanged, match="moved from"):
        r(ids, pos, seq_lens=[5, 3])


def test_a_tensors_runner_recaptures_with_the_shapes_of_its_first_call():
    torch.manual_seed(0)
    mlp = graphcap.models.MLP().to(DEVICE)
    r = graphcap.capture(mlp, "full", buckets=[4, 8])
    x = torch.randn(6, 64, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(r(x), mlp(x))
        mlp.net[0].weight = torch.nn.Parameter(torch.randn_like(mlp.net[0].weight))
        torch.testing.assert_close(r(x), mlp(x))
    assert r.report()["recaptures"] == 1


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_call_refused_after_a_change_leaves_the_shapes_its_graphs_take(strategy):
    # A changed model makes a tensors runner forget its shapes (the model may take others
    # now). A call refused then (an empty batch) left them forgotten beside the graphs of
    # the old ones: back as captured (autocast off), a call of other sizes or dtype was
    # staged into those graphs, broadcast or cast, and replayed where eager raises.
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(DEVICE)
    r = graphcap.capture(lin, strategy, buckets=[8],
                         example_inputs=(torch.randn(8, 4, device=DEVICE),))
    with torch.autocast(DEVICE, torch.bfloat16), pytest.raises(BadBatch, match="empty"):
        r(torch.empty(0, 4, device=DEVICE))
    for x in (torch.randn(5, 1, device=DEVICE), torch.randn(5, 4, device=DEVICE).double()):
        with pytest.raises(RuntimeError):
            lin(x)
        with pytest.raises(BadBatch):
            r(x)
    x = torch.randn(5, 4, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(r(x), lin(x))
    assert r.report()["recaptures"] == 0  # the model as captured: its graphs replay


def test_python_attributes_are_frozen_at_capture_until_recapture():
    # Documented: a graph bakes what forward reads from Python; recapture() re-reads it.
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.scale = 2.0

        def forward(self, x):
            return self.lin(x) * self.scale

    m = Scaled().to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, "full", buckets=[4], example_inputs=(x,))
    m.scale = 3.0
    with torch.no_grad():
        assert torch.allclose(r(x), m(x) * 2.0 / 3.0, atol=1e-5)
        r.recapture()
        torch.testing.assert_close(r(x), m(x))


@pytest.mark.parametrize("strategy", GRAPHED)
def test_model_train_and_eval_after_capture_switch_the_replays_dropout(strategy):
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)).to(DEVICE).eval()
    x = torch.randn(8, 64, device=DEVICE)
    r = graphcap.capture(m, strategy, buckets=[8], example_inputs=(x,))
    with torch.no_grad():
        want = m(x)
        torch.testing.assert_close(r(x), want)
        m.train()  # eager drops half the outputs and doubles the rest: so must replays
        dropped = r(x)
        zeros = float((dropped == 0).float().mean())
        assert 0.3 < zeros < 0.7, zeros  # 512 draws at p = 0.5
        kept = dropped != 0
        torch.testing.assert_close(dropped[kept], 2 * want[kept])
        m.eval()
        torch.testing.assert_close(r(x), want)
    assert r.report()["recaptures"] == 2


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_plain_tensor_attribute_stays_as_captured_never_freed_memory(strategy):
    # A tensor attribute that is no parameter or buffer is frozen at capture like any
    # Python attribute: the runner keeps the captured tensor alive, so a replay after the
    # model dropped it reads its values, not memory handed to someone else.
    class Tabled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.table = torch.randn(8)  # a plain attribute: no parameter, no buffer

        def forward(self, x):
            return self.lin(x) * self.table

    torch.manual_seed(0)
    m = Tabled().to(DEVICE)
    m.table = m.table.to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4], example_inputs=(x,))
    with torch.no_grad():
        want = m(x)
        old = weakref.ref(m.table)
        m.table = torch.randn(8, device=DEVICE)
        reused = [torch.full((8,), 1e4, device=DEVICE) for _ in range(8)]  # take freed blocks
        assert old() is not None
        torch.testing.assert_close(r(x), want)
        del reused
        r.recapture()
        torch.testing.assert_close(r(x), m(x))


def test_the_address_check_sees_one_moved_tensor_anywhere_among_many():
    from graphcap.core.snapshot import ptrs_equal

    base = torch.zeros(64, device=DEVICE)
    tensors = [torch.zeros(4, device=DEVICE) for _ in range(300)] + [base[8:]]
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs_equal(tensors, ptrs)
    for moved in (0, 137, len(tensors) - 1):
        kept = tensors[moved]
        tensors[moved] = kept.clone()
        assert not ptrs_equal(tensors, ptrs)
        tensors[moved] = kept
    assert ptrs_equal(tensors, ptrs)
    tensors[-1] = base[9:]  # the same storage at another offset: another address
    assert not ptrs_equal(tensors, ptrs)


@pytest.mark.parametrize("edit", ["append", "pop", "insert", "del", "extend", "clear",
                                  "dict pop", "dict set", "dict reorder", "sequential del",
                                  "param append"])
def test_every_edit_of_a_container_module_reads_as_a_change(edit):
    # The snapshot alone, no capture: containers edited in place, most of them without
    # a registration (their entries written into their dicts directly).
    from graphcap.core.snapshot import ModelSnapshot

    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    m.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    m.seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    m.scales = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(2))])
    snapshot = ModelSnapshot(m)
    assert snapshot.current() and not snapshot.changes()
    edits = {"append": lambda: m.layers.append(torch.nn.Linear(2, 2)),
             "pop": lambda: m.layers.pop(1),
             "insert": lambda: m.layers.insert(0, torch.nn.Linear(2, 2)),
             "del": lambda: m.layers.__delitem__(slice(0, 2)),
             "extend": lambda: m.layers.extend([torch.nn.Linear(2, 2)]),
             "clear": lambda: m.heads.clear(),
             "dict pop": lambda: m.heads.pop("a"),
             "dict set": lambda: m.heads.update({"c": torch.nn.Linear(2, 2)}),
             "dict reorder": lambda: m.heads.update({"a": m.heads.pop("a")}),
             "sequential del": lambda: m.seq.__delitem__(0),
             "param append": lambda: m.scales.append(torch.nn.Parameter(torch.ones(2)))}
    edits[edit]()
    assert not snapshot.current()
    assert any(" edited (" in line for line in snapshot.changes()), snapshot.changes()


def test_a_slot_filled_after_capture_reads_as_a_change():
    # A registration where the capture saw no slot: a bias given to a Linear built
    # without one, a submodule set on a plain module.
    from graphcap.core.snapshot import ModelSnapshot

    m = torch.nn.Module()
    m.proj = torch.nn.Linear(2, 2, bias=False)
    snapshot = ModelSnapshot(m)
    assert snapshot.current()
    m.proj.bias = torch.nn.Parameter(torch.zeros(2))
    assert not snapshot.current() and snapshot.changes() == ["proj.bias: added"]
    snapshot = ModelSnapshot(m)
    m.extra = torch.nn.Linear(2, 2)
    assert not snapshot.current()
    assert snapshot.changes()[:3] == ["extra: added", "extra.weight: added",
                                      "extra.bias: added"]


def test_a_parameter_set_to_none_after_capture_reads_as_a_change():
    # lin.bias = None empties the slot through no registration hook.
    from graphcap.core.snapshot import ModelSnapshot

    m = torch.nn.Module()
    m.proj = torch.nn.Linear(2, 2)
    snapshot = ModelSnapshot(m)
    m.proj.bias = None
    assert not snapshot.current() and snapshot.changes() == ["proj.bias: removed"]


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_bias_removed_after_capture_is_recaptured_without_it(strategy):
    m = fresh_model()
    m.blocks[0].attn.o.bias = torch.nn.Parameter(torch.ones_like(m.norm))
    r = capture(m, strategy)
    assert_matches_eager(r, m)
    m.blocks[0].attn.o.bias = None
    assert_matches_eager(r, m)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_call_under_other_autocast_settings_than_the_capture_is_a_change(strategy):
    # Graphs compute in the dtypes of their capture: captured under bf16 autocast, a call
    # outside it would return bf16 (and another call's values), or the other way round.
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(DEVICE)
    r = graphcap.capture(lin, strategy, buckets=[4])
    x = torch.randn(4, 16, device=DEVICE)
    with torch.autocast(DEVICE, torch.bfloat16):
        got = r(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, lin(x))
    got = r(x)
    assert got.dtype == torch.float32 and r.report()["recaptures"] == 1
    atol, rtol = tolerance()
    torch.testing.assert_close(got, lin(x), atol=atol, rtol=rtol)
    strict = graphcap.capture(lin, strategy, buckets=[4], on_change="error")
    strict(x)
    with torch.autocast(DEVICE, torch.bfloat16), pytest.raises(
            ModelChanged, match=rf"autocast on {DEVICE}"):
        strict(x)
