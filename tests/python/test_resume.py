"""ucp.resume in a real torch training loop: a tiny model trained with Adam,
dcp.save after each step (torchtitan's step-N folders), the last save cut
short as a kill during its write leaves it; ucp.resume names the previous
step, says why it skipped the last, and dcp.load from its load_dir gives
exactly that step's model and optimizer state."""

import copy

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _flat(sd, prefix=""):
    """{dotted key: tensor} of a nested state dict."""
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
    return out


def test_resume_after_killed_save_then_dcp_load(tmp_path):
    save = tmp_path / "save"
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {}
    for step in range(1, 5):
        _train_step(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd},
                 checkpoint_id=str(save / f"step-{step}"))
        saved[step] = _flat({"model": msd, "optimizer": osd})
    # Step 4's save killed half way through writing its data file.
    (data,) = (save / "step-4").glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    r = ucp.resume(save, dp=1)
    assert r.iteration == 3
    assert r.load_dir.rstrip("/").endswith("step-3"), r.load_dir
    assert [s.name for s in r.skipped] == ["step-4"], r.skipped
    assert r.skipped[0].iteration == 4 and r.skipped[0].reason
    assert r.consumed_samples is None and not r.reshaped

    # A fresh job loads what ucp.resume named.
    model2 = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    _train_step(model2, opt2, 99)  # other values everywhere, state created
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=r.load_dir)
    set_state_dict(model2, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    got = _flat({"model": model2.state_dict(), "optimizer": get_state_dict(model2, opt2)[1]})
    want = saved[3]
    compared = 0
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
        compared += tensor.numel()
    assert len(want) >= 3 * 4 and compared > 3 * (8 * 32 + 32 * 4)
    # Negative control: step 2's state differs from what was loaded.
    assert any(not torch.equal(got[k], saved[2][k]) for k in want)
    # Training goes on from step 3 exactly as the first run did after it.
    _train_step(model2, opt2, 4)
    step4 = _flat(model2.state_dict())
    for key, tensor in step4.items():
        assert torch.equal(tensor, saved[4]["model." + key]), key


def test_resume_reports_data_skip_and_errors(tmp_path):
    import pytest

    with pytest.raises(ucp.IoError) as info:
        ucp.resume(tmp_path / "none", dp=1)
    assert info.value.exit_code == 5 and "none" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ucp.FormatError, match="no checkpoint"):
        ucp.resume(tmp_path / "empty", dp=1)
