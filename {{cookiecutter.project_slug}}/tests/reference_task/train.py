# The project's train.py, frozen: the machinery's tests run it (tests/conftest.py).
{% include "train.py" %}