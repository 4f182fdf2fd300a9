# The two set-up commands of the README:
#   make run    the whole system locally (simulated workers, decision service, gateway)
#   make test   lint + type check + import contracts + real vLLM prepared + the whole test suite
# Both create .venv and install what they need; nothing is installed by hand (`make redis` installs
# Debian's redis-server when it is missing: the shared session store of `ppd-up --gateways N` and its
# tests; `make prometheus` Debian's prometheus and promtool, which the tests of deploy/prometheus and
# deploy/grafana run). `make vllm` prepares real vLLM on this CPU in its own venv (cached under
# ~/.cache/ppd-router, keyed by versions).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv run test lint typecheck vllm unit proto clean redis prometheus table-vllm-cpu docs chromium docs-screenshots

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# xds-protos (Envoy's ext_proc stubs) ships its own, older copy of opentelemetry/proto/**, and pip
	@# lets the last package installed win: when xds-protos lands after opentelemetry-proto, the OTLP
	@# exporter fails to import (InstrumentationScope missing). Put opentelemetry-proto's files back.
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps \
	  "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	$(BIN)/python -c 'from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP) redis
	$(BIN)/ppd-up $(ARGS)

# Debian's redis-server, only when missing (CI runs as root on Debian; elsewhere sudo asks). The
# package's own service is not started in containers (policy-rc.d); tests and ppd-up start their own.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }

# Debian's prometheus (with promtool), only when missing, as `make redis`: tests/deploy/test_prometheus.py
# checks deploy/prometheus's rules and alert cases with promtool and scrapes the local stack with a real
# Prometheus to check every panel of deploy/grafana. The package's own service is not started in
# containers (policy-rc.d); the tests start their own.
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# The real-vLLM test tier needs its venv and model; a failed preparation fails the run.
vllm: $(STAMP)
	$(BIN)/ppd-vllm prepare

test: lint typecheck vllm redis prometheus
	$(BIN)/pytest $(PYTEST_ARGS)

# The shipped real-vLLM table (tables/vllm-cpu/1P1D__tiny-llama-cpu.ppdt, its own folder so that the
# decision service's default key over tables/ stays the H100 tables; `ppd-up --engine vllm-cpu` serves
# it): a grid sized for this 2-core CPU: the five Turn-1-small workloads whose answers stay short, at
# 1/4, 1/2 and 1x the tiny model's pd capacity here (0.8 conversations/s, the ShareGPT ramp of
# `ppd-vllm ppd-effect`), the table's QPS axis on those same levels; resumable; about 40 minutes on a
# quiet machine.
VLLM_TABLE_WORKLOADS ?= small_tiny,small_small_bal,small_mid_bal,small_mid_paste,small_big_paste
VLLM_TABLE_QPS ?= 0.2,0.4,0.8
VLLM_TABLE_RUNS ?= runs/table-vllm-cpu
table-vllm-cpu: vllm
	$(BIN)/ppd-table sweep --engine vllm-cpu --shape 1P1D --model tiny-llama-cpu \
	  --workloads $(VLLM_TABLE_WORKLOADS) --qps $(VLLM_TABLE_QPS) --qps-levels $(VLLM_TABLE_QPS) \
	  --duration 40 --seed 0 --min-samples 3 --out $(VLLM_TABLE_RUNS) --publish tables/vllm-cpu/

# The documentation site (mkdocs.yml, pages in docs/) into site/; --strict makes a broken link, a missing
# page or anchor an error (tests/test_docs_site.py runs the same build under `make test`). Never -q:
# it hides the warnings --strict counts.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Debian's chromium, only when missing (as `make redis`): the headless browser of docs-screenshots.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

# The built site as a reader sees it: PNGs of the home page and two guides in site-shots/ (for a look by
# eye; not a test, a browser start is too slow for CI). Headless, no GPU, no network, no profile sync.
DOCS_SHOTS ?= index guides/tour guides/kubernetes-envoy reference/settings
docs-screenshots: docs chromium
	mkdir -p site-shots
	for page in $(DOCS_SHOTS); do \
	  chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
	    --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
	    --window-size=1280,1800 --screenshot=site-shots/$$(echo $$page | tr / -).png \
	    "file://$(CURDIR)/site/$$page.html" 2>/dev/null; \
	done

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis site site-shots
