"""Checks the answers before cookiecutter writes any file.

The checks (local_extensions.answer_problem) run while cookiecutter renders this script,
in cookiecutter's own process: a bad answer then stops generation with one line saying what
to change, cookiecutter leaves nothing behind, and no 'Hook script failed' line follows, as
it would after a script that exits non-zero. The rendered script has nothing left to do.
"""

# {{ cookiecutter | refuse_bad_answers }}
