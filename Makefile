# Convenience targets; scripts/ holds the real logic.
GO ?= go
export PATH := $(PATH):/usr/local/go/bin

.PHONY: test lint bench build vet deps

# The full test command, as CI runs it: deps, lint, all test tiers.
test:
	./scripts/test.sh

lint:
	./scripts/lint.sh

deps:
	./scripts/deps.sh

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

build:
	$(GO) build ./...

vet:
	$(GO) vet ./...
