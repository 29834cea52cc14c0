# The project's recipe.py, frozen: the machinery's tests train with it (tests/conftest.py).
{% include "recipe.py" %}