"""What a fresh process imports, in one interpreter (tests/test_cli_contract.py), as argv[1]
(JSON) says: the ``clis`` modules (for ``--help``), then the ``metadata`` commands
(``mimo-shard`` argument lists, run), then the ``commands`` modules, then for each
preprocessing config of ``configs`` a ``Preprocessor`` and the preprocessing of every
``every``-th sample of the ``dataset``. Prints one JSON line: the heavy libraries after the
CLIs, after the metadata commands and after the commands, and per config the samples kept,
the media items preprocessed by modality and the transformers/torchvision modules that
preprocessing imported after the ``Preprocessor`` was built (what its forked workers would
each import again)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

HEAVY = ("torch", "transformers", "pyarrow", "webdataset", "megatron", "PIL")


def _loaded(prefixes: tuple[str, ...]) -> set[str]:
    return {name for name in sys.modules if name.split(".")[0] in prefixes}


def main() -> None:
    import importlib
    asked = json.loads(sys.argv[1])
    found: dict = {}
    for step in ("clis", "metadata", "commands"):
        for what in asked[step]:
            if step == "metadata":
                from mimo_data.shards.cli import main as shard_main
                with contextlib.redirect_stdout(io.StringIO()):
                    assert shard_main(what) == 0, what
            else:
                importlib.import_module(what)
        found[step] = sorted(_loaded(HEAVY) & set(HEAVY))

    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.preprocessor import Preprocessor, preprocess_dataset
    from mimo_data.shards.reader import ShardReader
    from mimo_data.tally import Tally
    found["configs"] = {}
    for path in asked["configs"]:
        preprocessor = Preprocessor(PreprocessConfig.from_yaml(path))
        before = _loaded(("transformers", "torchvision"))
        reader = ShardReader(asked["dataset"])
        samples = list(preprocess_dataset(reader, preprocessor, Tally(),
                                          range(0, len(reader), asked["every"])))
        found["configs"][path] = {
            "kept": len(samples),
            "items": {m: sum(len(s.token_counts.get(m, ())) for s in samples)
                      for m in preprocessor.config.modalities},
            "imported": sorted(_loaded(("transformers", "torchvision")) - before)}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
