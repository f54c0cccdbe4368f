# The two Quick start commands: `make run` and `make test`. Each creates or refreshes the
# virtual environment itself (torch pinned to the CPU build through constraints.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install

.PHONY: run test lint format

# One line per step with its elapsed time (pip itself is quiet: its output is noise here).
$(STAMP): pyproject.toml constraints.txt
	@start=$$(date +%s); \
	test -x $(PY) || { echo "creating $(VENV)"; python3 -m venv $(VENV) || exit 1; }; \
	echo "installing ringlab and its dependencies into $(VENV) (the first time: about 2 minutes)"; \
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,adapters]' \
		&& touch $(STAMP) \
		&& echo "installed in $$(( $$(date +%s) - start )) s"

# The demo: the service on SQLite with a local CPU Ray, examples/cpu-quick.yaml submitted, the
# dashboard URL printed; it keeps serving until Ctrl-C. PORT=8001 make run picks another port.
PORT ?= 8000
run: $(STAMP)
	$(VENV)/bin/ringlab demo --port $(PORT)

# The tests also need the example kernel plugin (docs/plugins.md) and the wrong and broken
# plugins of tests/plugins installed: they run them through the service.
PLUGINS := examples/plugin tests/plugins
PLUGINS_STAMP := $(VENV)/.stamp-plugins
$(PLUGINS_STAMP): $(STAMP) $(foreach p,$(PLUGINS),$(p)/pyproject.toml)
	@$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt --no-deps \
		$(foreach p,$(PLUGINS),-e $(p)) && touch $(PLUGINS_STAMP) \
		&& echo "installed the test plugins: $(PLUGINS)"

test: $(STAMP) $(PLUGINS_STAMP)
	VENV=$(VENV) bash scripts/test.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
