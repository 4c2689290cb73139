"""Honest oracle checks: a comparison counts what it compared, a minimum
count is asserted, and a negative control shows the comparison can fail.

    n = oracle_checks.checked(compare, got, min_count=10, what="case x")

runs `compare(got)` (which raises AssertionError on a difference and returns
the number of values it compared), asserts n >= min_count, then runs
`compare` again on a copy of `got` with one value of one tensor / array
changed (`perturbed`) and asserts that it raises AssertionError. The copy
shares everything but the changed tensor and the containers above it, so the
control costs one more comparison in memory, nothing re-run.

`compare_values(got, want, what)` is such a comparison for nested dicts,
lists, tuples of torch tensors, numpy arrays and plain values: same keys,
same dtype and shape, equal bit for bit (NaNs included); it returns the
number of tensor elements and plain values compared.

`join_ranks(procs, seconds)` and `join_context(context, seconds)` wait for
forked ranks (multiprocessing.Process objects / torch's ProcessContext) until
a deadline: a rank still running then is killed and the check fails, and a
rank that exited non-zero fails it too.

Works with Debian's python3 (torch 1.13) and the tests' venv; torch and
numpy are imported only when the values need them.

  oracle_checks.py --self-test
"""
import sys
import time


def _torch():
    return sys.modules.get("torch")


def _numpy():
    return sys.modules.get("numpy")


def _is_tensor(v):
    t = _torch()
    return t is not None and isinstance(v, t.Tensor)


def _is_array(v):
    np = _numpy()
    return np is not None and isinstance(v, (np.ndarray, np.generic))


def _elements(v):
    return v.numel() if _is_tensor(v) else int(v.size)


def _same_bits(a, b):
    if _is_tensor(a):
        a = a.detach().contiguous().reshape(-1)
        b = b.detach().contiguous().reshape(-1)
        if a.numel() == 0:
            return True
        return bool((a.view(_torch().uint8) == b.view(_torch().uint8)).all())
    np = _numpy()
    a, b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    return a.tobytes() == b.tobytes()


def compare_values(got, want, what="", *, keys="equal"):
    """Asserts `got` equals `want` (nested dict / list / tuple of tensors,
    arrays and plain values; tensors and arrays: same type, dtype, shape and
    bytes). keys="equal": both dicts have the same keys; keys="want": every
    key of `want` is in `got` (extra keys of `got` ignored). Returns the
    number of values compared (tensor elements, plain values)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), (what, type(got).__name__)
        if keys == "equal":
            assert set(got) == set(want), (what, "keys differ", sorted(map(str, set(got) ^ set(want)))[:10])
        else:
            missing = set(want) - set(got)
            assert not missing, (what, "missing", sorted(map(str, missing))[:10])
        return sum(compare_values(got[k], v, f"{what}.{k}", keys=keys) for k, v in want.items())
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (what, got, want)
        return sum(compare_values(g, w, f"{what}[{i}]", keys=keys)
                   for i, (g, w) in enumerate(zip(got, want)))
    if _is_tensor(want) or _is_array(want):
        assert type(got) is type(want) or (_is_tensor(got) and _is_tensor(want)), \
            (what, type(got).__name__, type(want).__name__)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
            (what, got.dtype, want.dtype, tuple(got.shape), tuple(want.shape))
        assert _same_bits(got, want), (what, "values differ")
        return _elements(want)
    assert got == want or (got != got and want != want), (what, got, want)
    return 1


def _leaves(obj, path=()):
    """(path, tensor or array) of every non-empty tensor / array, in order."""
    if isinstance(obj, dict):
        for k in obj:
            yield from _leaves(obj[k], path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    elif (_is_tensor(obj) or _is_array(obj)) and _elements(obj) > 0:
        yield path, obj


def _changed(v):
    """A copy of tensor / array `v` with its middle element changed (by far
    more than any tolerance: x -> -x - 1, or another value where that rounds
    back to x)."""
    if _is_tensor(v):
        c = v.detach().clone().contiguous()
        flat = c.view(-1)
        i = flat.numel() // 2
        old = flat[i].item()
        if c.dtype == _torch().bool:
            flat[i] = not old
            return c, i
        for new in ((-old - 1), 1, 0, 2):
            flat[i] = new
            if flat[i].item() != old:
                return c, i
        raise AssertionError(f"cannot change element {i} of a {c.dtype} tensor")
    np = _numpy()
    scalar = isinstance(v, np.generic)
    c = np.array(v, copy=True)
    flat = c.reshape(-1)
    i = flat.size // 2
    old = flat[i]
    if c.dtype == np.bool_:
        flat[i] = not old
        return (c[()] if scalar else c), i
    for new in ((-old - 1), 1, 0, 2):
        try:
            flat[i] = new
        except (OverflowError, TypeError, ValueError):
            continue
        if not (flat[i] == old):
            return (c[()] if scalar else c), i
    raise AssertionError(f"cannot change element {i} of a {c.dtype} array")


def _replace(obj, path, value):
    """A copy of `obj` with the leaf at `path` replaced (containers on the
    path copied, everything else shared)."""
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = type(obj)(obj)
        out[k] = _replace(obj[k], rest, value)
        return out
    items = list(obj)
    items[k] = _replace(obj[k], rest, value)
    if isinstance(obj, list) or type(obj) is tuple:
        return type(obj)(items)
    return type(obj)(*items)  # a namedtuple


def perturbed(got, pick=None):
    """(copy of `got` with one element of one tensor / array changed, where).
    The tensor is the middle one of all non-empty tensors / arrays in walk
    order (or leaves[pick])."""
    leaves = list(_leaves(got))
    assert leaves, "negative control: nothing to change (no non-empty tensor or array)"
    path, v = leaves[len(leaves) // 2 if pick is None else pick]
    c, i = _changed(v)
    return _replace(got, path, c), f"{'.'.join(map(str, path)) or '<value>'}[{i}]"


def negative_control(compare, got, what="", pick=None):
    """Asserts that `compare` fails (AssertionError) on a copy of `got` with
    one value changed."""
    bad, where = perturbed(got, pick)
    try:
        compare(bad)
    except AssertionError:
        return
    raise AssertionError(f"{what}: negative control: {where} changed and the comparison still passed")


def checked(compare, got, min_count, what="", pick=None):
    """compare(got) -> number of values compared (raises AssertionError on a
    difference); asserts at least `min_count` values were compared, then the
    negative control. Returns the count."""
    n = compare(got)
    assert isinstance(n, int) and n >= min_count, \
        f"{what}: {n} values compared, fewer than the {min_count} expected"
    negative_control(compare, got, what, pick)
    return n


def join_ranks(procs, seconds, what="ranks"):
    """Waits for multiprocessing.Process ranks until `seconds` from now; a
    rank still running then is killed and is a failure, as is a non-zero
    exit."""
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].kill()
    for r in alive:
        procs[r].join(10)
    assert not alive, f"{what}: rank(s) {alive} still running after {seconds} s (killed)"
    codes = [p.exitcode for p in procs]
    assert all(c == 0 for c in codes), f"{what}: exit codes {codes}"


def join_context(context, seconds, what="ranks"):
    """The same for torch.multiprocessing's ProcessContext (start_processes
    with join=False); its join raises on a rank's error."""
    deadline = time.monotonic() + seconds
    while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
            for r in alive:
                context.processes[r].kill()
            for r in alive:
                context.processes[r].join(10)
            raise AssertionError(f"{what}: rank(s) {alive} still running after {seconds} s (killed)")


def _sleep(seconds):
    time.sleep(seconds)


def _self_test():
    import multiprocessing
    import numpy as np
    try:
        import torch
    except ImportError:
        torch = None
    want = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": [np.int64(3), 2.5],
            "c": {"d": np.array([True, False]), "e": "x"}}
    got = {"a": want["a"].copy(), "b": [np.int64(3), 2.5], "c": {"d": want["c"]["d"].copy(), "e": "x"}}
    n = checked(lambda g: compare_values(g, want, "np"), got, min_count=16, what="np")
    assert n == 12 + 2 + 2 + 1, n
    for pick in range(3):  # every leaf can be the changed one
        negative_control(lambda g: compare_values(g, want, "np"), got, "np", pick)
    assert got["a"][1, 2] == 6.0, "the control changed the caller's data"
    try:
        checked(lambda g: compare_values(g, want, "np"), got, min_count=100, what="np")
        raise RuntimeError("count rule not enforced")
    except AssertionError as e:
        assert "fewer than" in str(e), e
    try:  # a comparison blind to values fails its control
        checked(lambda g: compare_values(set(g), set(want)) or 20, got, 1, "blind")
        raise RuntimeError("blind comparison passed its negative control")
    except AssertionError as e:
        assert "negative control" in str(e), e
    if torch is not None:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
            w = {"t": (torch.arange(6) % 2 if dtype == torch.bool else torch.arange(6) * 300).to(dtype)}
            g = {"t": w["t"].clone()}
            checked(lambda x: compare_values(x, w, str(dtype)), g, 6, str(dtype))
        nan = torch.tensor([float("nan"), 1.0])
        compare_values({"n": nan.clone()}, {"n": nan})
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_sleep, args=(60,))
    p.start()
    t0 = time.monotonic()
    try:
        join_ranks([p], 1, "sleeper")
        raise RuntimeError("a rank still running passed")
    except AssertionError as e:
        assert "still running" in str(e) and not p.is_alive() and time.monotonic() - t0 < 20, e
    p = ctx.Process(target=sys.exit, args=(3,))
    p.start()
    try:
        join_ranks([p], 30, "exit 3")
        raise RuntimeError("a failed rank passed")
    except AssertionError as e:
        assert "exit codes [3]" in str(e), e
    print("oracle_checks self-test: ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        _self_test()
    else:
        sys.exit(__doc__)
