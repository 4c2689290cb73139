"""Importable classes for the pickle corpus (see tests/tools/stubs/README.md).

Classes defined in a script's own module pickle as `__main__.X`, which no other
process can load; these live here so that make_pickle_corpus.py and
check_pickle_roundtrip.py both import them under one module path.
"""
import collections
import dataclasses
import enum


class Color(enum.Enum):
    RED = 1
    GREEN = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 10


@dataclasses.dataclass
class Point:
    x: int
    y: float
    tags: list = dataclasses.field(default_factory=list)


class Plain:
    """An object without __eq__: pickled as NEWOBJ + BUILD(__dict__)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class Slotted:
    """__slots__ and no __dict__: BUILD state is (None, {slot: value})."""
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a = a
        self.b = b


class Outer:
    class Inner:
        """A nested class: protocol < 4 names it getattr(Outer, 'Inner')."""

        def __init__(self, value):
            self.value = value


class ListSub(list):
    """APPENDS go to the object itself."""


class DictSub(dict):
    """SETITEMS go to the object itself."""


NamedT = collections.namedtuple("NamedT", ["left", "right"])


class KwOnly:
    """__getnewargs_ex__: NEWOBJ_EX with protocol >= 4."""

    def __new__(cls, *args, scale=1, **kwargs):
        obj = super().__new__(cls)
        obj.scale = scale
        obj.args = args
        return obj

    def __getnewargs_ex__(self):
        return self.args, {"scale": self.scale}
