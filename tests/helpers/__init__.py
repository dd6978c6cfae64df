"""What the tests share: paths, the command line and its argument lists (``cli``), data sets on disk
(``data_files``), models (``tiny_models``, ``text_models``) and the token jobs (``text_jobs``), an
independent forward (``reference``), stores from arrays and their comparisons (``stores``), forked and
launched runs (``forked``, ``launches``), and moto's S3 server with a fault proxy in front of it (``s3``,
``faultproxy``).

Tests import them as ``helpers.X`` (``tests/`` is on ``sys.path``: pytest's ``pythonpath``). Scripts
run by path (``job_sequence.py``, ``ddp_sampler_script.py``, ``s3_forked.py``) live here too, and the
CLI loads ``tiny_models.py`` by path (``--model tests/helpers/tiny_models.py:NAME``)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
ROOT = TESTS.parent
TINY = HELPERS / "tiny_models.py"  # for --model f"{TINY}:NAME" (the factory source loads it by path)
