"""What the experiment scripts share: where results go, JSON, cached checkpoints, timing, figures.

    import common                                   # the scripts run as `python experiments/NN_name.py`
    out = common.out_path("05_cache", args.out, args.quick)
    ckpt = common.cached("05_cache", recipe, train_fn, retrain=args.retrain, quick=args.quick)
    common.write_json(out, results)
    common.save_figure(lambda plt: ..., out.with_suffix(".png"))
"""

import dataclasses
import hashlib
import json
import pathlib
import tempfile
import time

from minagent import train
from minagent.tasks.calculator import demo

EXPERIMENTS = pathlib.Path(__file__).resolve().parent
REPO = EXPERIMENTS.parent
DATA = EXPERIMENTS / "data"          # corpora made by data/make_corpus.sh (git-ignored)
RESULTS = EXPERIMENTS / "results"    # JSON and figures (committed), checkpoints and tokenizers (git-ignored)


def in_repo(path):
    """A path as the JSON shows it: relative to the repository ("experiments/results/..."), when inside it."""
    path = pathlib.Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ---------------------------------------------------------------- results

def count(k, n):
    """A count and what it is out of: count(3, 4) -> {"k": 3, "n": 4, "rate": 0.75} (rate None when n == 0)."""
    return dict(k=int(k), n=int(n), rate=k / n if n else None)


def out_path(name, out=None, quick=False):
    """Where a run writes its JSON, and its figures beside it: --out if given, else results/NAME.json.
    A --quick run defaults to a temporary folder: a smoke test never overwrites the committed results."""
    if out:
        return pathlib.Path(out)
    folder = pathlib.Path(tempfile.gettempdir()) / "minagent-quick" if quick else RESULTS
    return folder / f"{name}.json"


def write_json(path, results, merge=False):
    """Write `results` to path as JSON. merge=True (a run with --only): its keys replace those of the
    file already there, and the other parts stay -> what was written."""
    path = pathlib.Path(path)
    if merge and path.exists():
        results = {**json.loads(path.read_text()), **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print(f"-> {path}")
    return results


def timed(fn, *args, **kw):
    """fn(*args, **kw) -> (what it returns, seconds it took)."""
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- checkpoints, keyed by their recipe

def checkpoint_path(name, recipe):
    """results/NAME-HASH.ckpt, HASH a short hash of `recipe`: a JSON-able dict of every argument that
    changes the model. Change any of them and the name changes, so the model is trained again."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    return RESULTS / f"{name}-{digest}.ckpt"


def cached(name, recipe, train_fn, *, retrain=False, quick=False, params_like=None):
    """The model `recipe` makes, trained once -> a dict as train.load_checkpoint's (params, cfg,
    tokenizer, extra, ...), plus `cached` (loaded, not trained now) and `path` (None under --quick).

    If checkpoint_path(name, recipe) exists (and not retrain) it is loaded (params_like: the
    structure of what was saved, e.g. LoRA adapters). Else train_fn(path) trains, writes the
    checkpoint at path unless path is None, and returns such a dict itself. --quick: path None,
    nothing read or written, so a smoke test leaves the real checkpoints alone.
    """
    path = None if quick else checkpoint_path(name, recipe)
    if path is not None and path.exists() and not retrain:
        print(f"{name}: the cached model {in_repo(path)}")
        return dict(train.load_checkpoint(path, params_like=params_like), cached=True, path=path)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    return dict(train_fn(path), cached=False, path=path)


def small_checkpoint(name, missions, steps, seed):
    """Where experiments/03 saves its small model `name` ("tool" or "direct"), trained with the demo's
    recipe on `missions` missions for `steps` steps, and where experiments/04 looks for it."""
    recipe = dict(missions=missions, arch=demo.SMALL, tcfg=dataclasses.asdict(demo.small_tcfg(steps, seed)))
    return checkpoint_path(f"03_small_{name}", recipe)


# ---------------------------------------------------------------- figures

def save_figure(draw, path):
    """draw(plt) -> a matplotlib Figure, saved at path (a PNG). Figures need the `plot` extra
    (pip install -e '.[plot]'); without matplotlib this says so and draws nothing -> path or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")                # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no figure {pathlib.Path(path).name}: matplotlib is not installed; pip install -e '.[plot]')")
        return None
    fig = draw(plt)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"-> {path}")
    return path
