# The example task, frozen: the machinery's tests train it (tests/conftest.py).
{% include "tasks/classification/synthetic_data.py" %}