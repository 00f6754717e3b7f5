"""draftling: train, measure and ship EAGLE-3 draft heads for Hugging Face causal LMs.

Import order. Each line below is a stage, lowest first: a module imports from its own stage
and from the lines above it, never from a line below (function-level imports included), and
no two modules import each other, directly or round a loop. tests/test_import_order.py reads
this list and checks every module against it.

    base     errors logs trackers io config dtypes timing hardware progress faults dynamo network
    target   target
    data     data
    draft    draft
    engine   engine
    train    train
    export   export
    bench    bench
    recipes  recipes
    cli      cli __main__

Each name is a module or subpackage of draftling (the package itself is base). A stage's
on-disk formats are read where they are written: tokenized data in data/tokenized.py, the
draft format in draft/store.py, the SGLang serving format (and load_any_draft, which reads
either kind) in export/formats.py; the vLLM speculators format is only written. engine
(decoding) and train do not import each other; engine sits lower because it needs only
target and draft. export sits below bench because bench reads exported drafts.
"""

__version__ = "0.1.0"

from draftling.logs import install_default as _install_logging  # noqa: E402

_install_logging()  # status lines to stdout, warnings to stderr, as logs.py says
