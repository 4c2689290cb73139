"""Writes data/mcore_0.16_rank_grid.json: each rank's coordinates in megatron-core 0.16's two
rank grids (parallel_state.RankGenerator with initialize_model_parallel's default order
"tp-cp-ep-dp-pp"), the dense one (tp, dp, pp; cp 1) and the expert one (etp, ep, edp, pp), for
every tp, pp, dp, ep, etp in a small grid where etp x ep x pp divides the world. Read by
moe_test.cc (RankCoordinatesMatchMegatronCore). Not run by ctest; regenerate with the tests'
venv python (no process group needed: RankGenerator is pure):

  ~/.cache/ucp/venv/bin/python make_mcore_rank_grid.py --out data/mcore_0.16_rank_grid.json
"""
import argparse
import itertools
import json

from megatron.core.parallel_state import RankGenerator

ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default order


def positions(gen, token, world):
    """rank -> its index inside its `token` group (its coordinate along that axis)."""
    out = [None] * world
    for group in gen.get_ranks(token):
        for i, r in enumerate(group):
            assert out[r] is None
            out[r] = i
    assert None not in out
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs = []
    for tp, pp, dp, ep, etp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3, 4, 6),
                                                 (1, 2, 4), (1, 2, 4)):
        world = tp * pp * dp
        if world % (etp * ep * pp):
            continue
        edp = world // (etp * ep * pp)
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=ORDER)
        expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=ORDER)
        cols = [positions(dense, "tp", world), positions(dense, "dp", world),
                positions(dense, "pp", world), positions(expert, "tp", world),
                positions(expert, "ep", world), positions(expert, "dp", world),
                positions(expert, "pp", world)]
        runs.append({"tp": tp, "pp": pp, "dp": dp, "ep": ep, "etp": etp,
                     "ranks": [list(x) for x in zip(*cols)]})
    with open(a.out, "w") as f:
        json.dump({"megatron_core": "0.16", "order": ORDER,
                   "columns": ["tp", "dp", "pp", "etp", "ep", "edp", "expert_pp"],
                   "runs": runs}, f, separators=(",", ":"))
        f.write("\n")
    print(len(runs), "topologies")


if __name__ == "__main__":
    main()
