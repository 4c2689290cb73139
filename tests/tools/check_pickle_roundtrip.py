#!/usr/bin/python3
"""Checks that two pickles load to equal Python objects.

    check_pickle_roundtrip.py ORIGINAL.pkl REWRITTEN.pkl [ORIG2 REWR2 ...]

Both files are loaded with CPython's pickle (tests/tools/stubs on sys.path for
the framework stand-ins) and compared deeply: same types, values (NaN equals
NaN, -0.0 differs from 0.0), dict order, numpy dtype/shape/bytes, objects by
their __reduce_ex__(2) structure (which covers __dict__, slots, BUILD state
and list/dict items of subclasses), and the same sharing: an object reached
twice on one side is reached twice, as one object, on the other (so cycles and
memo sharing must survive). Exit status 0 if every pair is equal, 1 with a
message per differing pair if not.
Only ever pass pickles from the test corpus: loading runs their reductions.
"""
import collections
import copyreg
import enum
import math
import os
import pickle
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "stubs"))

import numpy as np  # noqa: E402

ATOMS = (type(None), bool, int, float, complex, str, bytes)


class _Mismatch(Exception):
    pass


def _tracked(x):
    """Objects whose identity the comparison keeps consistent."""
    if isinstance(x, ATOMS) or x is Ellipsis or x is NotImplemented:
        return False
    if isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType,
                      enum.Enum)):
        return False  # singletons by name
    if type(x) is tuple and not x:
        return False
    return True


def _reduce(x):
    try:
        rv = x.__reduce_ex__(2)
    except Exception:  # noqa: BLE001 - fall back to the instance dict
        return None
    if isinstance(rv, str):
        return None
    rv = list(rv) + [None] * (6 - len(rv))
    func, args, state, listitems, dictitems, _ = rv
    if func is copyreg.__newobj__:
        func, args = args[0], args[1:]
    return (func, args, state,
            list(listitems) if listitems is not None else None,
            list(dictitems) if dictitems is not None else None)


class _Comparer:
    def __init__(self):
        self.a_to_b = {}
        self.b_to_a = {}
        self.keep = []  # keeps temporaries alive so their ids stay unique

    def check(self, a, b, path):
        if type(a) is not type(b):
            raise _Mismatch("%s: type %s vs %s" % (path, type(a).__name__,
                                                   type(b).__name__))
        if _tracked(a):
            ia, ib = id(a), id(b)
            if ia in self.a_to_b or ib in self.b_to_a:
                if self.a_to_b.get(ia) != ib or self.b_to_a.get(ib) != ia:
                    raise _Mismatch("%s: sharing differs" % path)
                return  # already compared (or being compared: a cycle)
            self.a_to_b[ia] = ib
            self.b_to_a[ib] = ia
            self.keep += [a, b]
        if isinstance(a, float):
            if math.isnan(a) and math.isnan(b):
                return
            if a != b or math.copysign(1, a) != math.copysign(1, b):
                raise _Mismatch("%s: %r vs %r" % (path, a, b))
            return
        if isinstance(a, complex):
            self.check(a.real, b.real, path + ".real")
            self.check(a.imag, b.imag, path + ".imag")
            return
        if isinstance(a, ATOMS):
            if a != b:
                raise _Mismatch("%s: %r vs %r" % (path, a, b))
            return
        if a is b:
            return
        if isinstance(a, (type, types.FunctionType, types.BuiltinFunctionType,
                          enum.Enum)) or a is Ellipsis or a is NotImplemented:
            raise _Mismatch("%s: %r is not %r" % (path, a, b))
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape or \
                    a.tobytes() != b.tobytes() or \
                    a.flags.f_contiguous != b.flags.f_contiguous:
                raise _Mismatch("%s: arrays differ" % path)
            return
        if isinstance(a, np.generic):
            if a.dtype != b.dtype or a.tobytes() != b.tobytes():
                raise _Mismatch("%s: numpy scalars differ" % path)
            return
        if type(a) in (list, tuple):
            if len(a) != len(b):
                raise _Mismatch("%s: length %d vs %d" % (path, len(a), len(b)))
            for i, (x, y) in enumerate(zip(a, b)):
                self.check(x, y, "%s[%d]" % (path, i))
            return
        if type(a) is bytearray:
            if a != b:
                raise _Mismatch("%s: %r vs %r" % (path, a, b))
            return
        if type(a) in (set, frozenset):
            if a != b:
                raise _Mismatch("%s: %r vs %r" % (path, a, b))
            return
        if type(a) in (dict, collections.OrderedDict):
            self._items(list(a.items()), list(b.items()), path)
            if type(a) is collections.OrderedDict:
                self.check(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}),
                           path + ".__dict__")
            return
        ra, rb = _reduce(a), _reduce(b)
        if ra is None or rb is None:
            self.check(getattr(a, "__dict__", None), getattr(b, "__dict__", None),
                       path + ".__dict__")
            return
        self.keep += [ra, rb]
        names = ("callable", "args", "state", "items", "entries")
        for name, x, y in zip(names, ra, rb):
            if name == "callable":
                if x is not y and x != y:
                    raise _Mismatch("%s: reduces with %r vs %r" % (path, x, y))
                continue
            self.check(x, y, "%s.<%s>" % (path, name))

    def _items(self, ia, ib, path):
        if len(ia) != len(ib):
            raise _Mismatch("%s: %d vs %d entries" % (path, len(ia), len(ib)))
        for (ka, va), (kb, vb) in zip(ia, ib):
            self.check(ka, kb, "%s.key(%r)" % (path, ka))
            self.check(va, vb, "%s[%r]" % (path, ka))


def explain(a, b):
    """None if a and b are equal in the sense above, else the difference."""
    try:
        _Comparer().check(a, b, "root")
    except _Mismatch as e:
        return str(e)
    return None


def equal(a, b):
    return explain(a, b) is None


def main():
    files = sys.argv[1:]
    if not files or len(files) % 2 != 0:
        sys.exit(__doc__)
    failed = 0
    for original, rewritten in zip(files[0::2], files[1::2]):
        try:
            with open(original, "rb") as f:
                a = pickle.load(f)
            with open(rewritten, "rb") as f:
                b = pickle.load(f)
            why = explain(a, b)
        except Exception as e:  # noqa: BLE001 - report and go on
            why = "cannot load: %s: %s" % (type(e).__name__, e)
        if why is not None:
            print("%s vs %s differ: %s" % (original, rewritten, why))
            failed += 1
    if failed:
        sys.exit(1)
    print("%d pairs equal" % (len(files) // 2))


if __name__ == "__main__":
    main()
