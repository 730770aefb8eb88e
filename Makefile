GO ?= go
BIN := bin/quotad
PROTOC ?= protoc

.PHONY: all build image test-compose test-upgrade test-ca-rotation run test test-short test-envoy race vet lint proto bench bench-fair bench-soak bench-shares bench-regions test-regions test-regions-bugs chaos chaos-long chaos-bugs chaos-docker clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/quotad

# Version and commit stamped into the binary (quotad version, quotad_build_info).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS := -X github.com/quotad/quotad/internal/buildinfo.version=$(VERSION) -X github.com/quotad/quotad/internal/buildinfo.commit=$(COMMIT)

# image builds the container image $(IMAGE) FROM scratch from a static binary compiled here
# (deploy/Dockerfile; nothing is pulled). deploy/compose.yaml runs it (docs/operations.md).
IMAGE ?= quotad:latest
image:
	rm -rf bin/image && mkdir -p bin/image/data && chmod 1777 bin/image/data
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/image/quotad ./cmd/quotad
	cp deploy/Dockerfile bin/image/Dockerfile
	docker build --label io.quotad.image=1 -t $(IMAGE) bin/image
	@docker image ls $(IMAGE) --format 'built {{.Repository}}:{{.Tag}} ({{.Size}})'

# test-compose brings deploy/compose.yaml up (image, credentials, 3 nodes), acquires, kills
# the leader's container, acquires again and tears everything down; skips without Docker.
test-compose:
	QUOTAD_COMPOSE=1 $(GO) test -count=1 -timeout 10m -run 'TestCompose' -v ./deploy/

# test-upgrade builds the quotad of UPGRADE_FROM (a git commit; default: main before the FSM
# command version 2) and upgrades a 3-process cluster of it to this tree node by node under
# load, checking nothing acknowledged is lost, nothing spent twice, replicas equal; and that
# old nodes stop on newer entries rather than diverge (docs/operations.md "Rolling upgrade").
UPGRADE_FROM ?= b79e26e
test-upgrade:
	QUOTAD_UPGRADE=1 QUOTAD_UPGRADE_FROM=$(UPGRADE_FROM) $(GO) test -count=1 -timeout 10m -run 'TestRollingUpgrade|TestOldNodesStop' -v ./e2e/

# test-ca-rotation replaces the CA of a 3-process cluster in three rolling restarts while a
# worker spends (docs/security.md "Rotating the CA without downtime"); about 25 s.
test-ca-rotation:
	QUOTAD_CA_ROTATION=1 $(GO) test -count=1 -timeout 5m -run 'TestCARotationWithoutDowntime' -v ./e2e/

# run starts a local 3-node cluster (separate processes) with examples/limits.yaml.
run: build
	./$(BIN) dev --nodes 3 --limits examples/limits.yaml

test:
	$(GO) vet ./...
	$(GO) test -timeout 15m ./...
	$(GO) test -race -timeout 15m ./quota/... ./fsm/... ./rpc/... ./cluster/... ./client/... ./sched/... ./region/...

# test-envoy: the differential test against envoyproxy/ratelimit (issue 14): builds it and a
# miniredis from the Go module proxy (cached in the user cache dir; needs the network the first
# time), runs it beside a secure 3-node quotad cluster, compares config verdicts and RLS answers
# (about a minute after the first build). .ci/run calls it.
test-envoy:
	QUOTAD_ENVOY_DIFF=1 $(GO) test -count=1 -timeout 10m -run 'TestEnvoyDifferential|TestEnvoyExample' -v ./e2e/

# test-regions (issue 13): a secure global cluster of 3 processes and two secure regional
# clusters (their own CAs) under load: the global leader killed (regions keep deciding on their
# shares, the bound across regions holds), every global node killed for 3 terms (shares, then
# fallback_rate; a level without one refused naming the global scope), restart (every region
# on a share within 2 terms, bound again); then region.TestRegionsFaults: in-process, a global
# cluster of 3 and two regions, region A partitioned from the global cluster (stall, then
# reset) while global leaders are killed and restarted, healed; checked on the admission
# history (docs/regions.md). About 3.5 minutes; .ci/run calls it.
test-regions:
	QUOTAD_REGIONS_E2E=1 $(GO) test -count=1 -timeout 10m -run 'TestRegionsProcesses' -v ./e2e/
	QUOTAD_REGIONS_FAULTS=1 $(GO) test -count=1 -timeout 5m -run 'TestRegionsFaults' -v ./region/

# test-regions-bugs: deliberately broken builds that TestRegionsFaults must fail, each with the
# check that catches it (about 70 s each): a doubled share (the global bound), a grant used past
# its end (a fail-closed level admits), the fallback at the share's rate (the fallback slice);
# then a slice re-lent downstream not charged against the regional leader's local bucket, which
# TestRegionsRelend must fail on the global bound (about 20 s).
REGION_BUGS := region_bug_doubleshare:the-global-bound-is-broken region_bug_noend:strict-admitted region_bug_fallbackshare:more-than-its-slice-of-fallback_rate
test-regions-bugs:
	@for b in $(REGION_BUGS); do \
		tag=$${b%%:*}; want=$$(echo "$${b#*:}" | tr '-' ' '); \
		out=$$(QUOTAD_REGIONS_FAULTS=1 $(GO) test -tags $$tag -count=1 -timeout 5m -run 'TestRegionsFaults' -v ./region/ 2>&1); \
		if echo "$$out" | grep -q '^--- PASS'; then echo "$$out" | tail -20; echo "$$tag: TestRegionsFaults PASSED a broken build"; exit 1; fi; \
		if ! echo "$$out" | grep -q "$$want"; then echo "$$out" | tail -30; echo "$$tag: failed, but not with \"$$want\""; exit 1; fi; \
		echo "$$tag: caught ($$want)"; \
	done
	@out=$$($(GO) test -tags region_bug_doubleslice -count=1 -timeout 3m -run 'TestRegionsRelend' -v ./region/ 2>&1); \
	if echo "$$out" | grep -q '^--- PASS'; then echo "$$out" | tail -20; echo "region_bug_doubleslice: TestRegionsRelend PASSED a broken build"; exit 1; fi; \
	if ! echo "$$out" | grep -q "the global bound is broken"; then echo "$$out" | tail -30; echo "region_bug_doubleslice: failed, but not with \"the global bound is broken\""; exit 1; fi; \
	echo "region_bug_doubleslice: caught (the global bound is broken)"

# chaos: the CI-sized chaos suite against real processes (every fault kind, ~5 min).
CHAOS_DURATION ?= 4m
DURATION ?= 30m
chaos:
	QUOTAD_CHAOS=1 QUOTAD_CHAOS_REQUIRE_ALL=1 QUOTAD_CHAOS_DURATION=$(CHAOS_DURATION) $(GO) test -count=1 -timeout 14m -run 'TestChaos$$' -v ./chaos/

# chaos-long: the same for DURATION (default 30m).
chaos-long:
	QUOTAD_CHAOS=1 QUOTAD_CHAOS_REQUIRE_ALL=1 QUOTAD_CHAOS_DURATION=$(DURATION) $(GO) test -count=1 -timeout 0 -run 'TestChaos$$' -v ./chaos/

# chaos-docker: the same run with one container per node (image FROM scratch, private network;
# partitions by docker network disconnect, pauses by docker pause); skips without Docker.
chaos-docker:
	QUOTAD_CHAOS=1 QUOTAD_CHAOS_REQUIRE_ALL=1 QUOTAD_CHAOS_DURATION=$(CHAOS_DURATION) $(GO) test -count=1 -timeout 14m -run 'TestChaosDocker$$' -v ./chaos/

# chaos-bugs: deliberately broken builds that the checkers must catch.
chaos-bugs:
	QUOTAD_CHAOS=1 $(GO) test -count=1 -timeout 40m -run TestPlantedBugs -v ./chaos/

vet:
	$(GO) vet ./...

# lint fails when a file is not gofmt-ed, go vet or staticcheck complain, or go.mod/go.sum are
# not tidy (CI runs it: .ci/run). staticcheck comes from the module proxy at a pinned version.
STATICCHECK_VERSION ?= v0.8.2
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt: these files need gofmt -w:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags chaos ./cmd/... ./chaos/...
	$(GO) mod tidy -diff || (echo "go.mod/go.sum are not tidy: run go mod tidy"; exit 1)
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

# proto regenerates api/ (needs protoc from Debian's protobuf-compiler and the Go plugins:
# go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
# go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1).
proto:
	cd api && PATH="$$PATH:$$($(GO) env GOPATH)/bin" $(PROTOC) -I . \
		--go_out=. --go_opt=paths=source_relative \
		--go-grpc_out=. --go-grpc_opt=paths=source_relative \
		quotad/v1/quotad.proto quotad/v1/snapshot.proto quotad/fsm/v1/fsm.proto

# bench builds quotad, starts a real 3-node cluster of separate processes (fsync on) and a
# separate load generator using the Go client, and writes a table plus bench/results/latest.json
# (about 5 minutes; not part of `make test`). See docs/performance.md.
bench:
	$(GO) run ./bench/run

# bench-fair runs the fair-sharing scenarios of issue 4 and the rate sweep of issue 16
# (burst-1 buckets at 10..10,000 tokens/s: utilization, heavy tenants' share ratio, small
# tenants' wait p99 against 2 token intervals + commit p99) against a real 3-node cluster of
# separate processes and writes bench/results/fairness.json (about 4 minutes). The sweep
# alone: go run ./bench/fair -only rate_sweep [-sweep-rates 10,100,1000,10000].
# bench-soak alternates 30 s of load and 30 s of idle on a 3-node cluster for 10 minutes and
# counts leadership changes (must be 0); writes bench/results/soak.json.
bench-soak:
	$(GO) run ./bench/run -only soak -out bench/results/soak.json

bench-fair:
	$(GO) run ./bench/fair

# bench-shares measures the client's Limiter on a real 3-node cluster (issue 12): local
# decisions/s with 64 goroutines on 1000 keys (and the Raft entries meanwhile), the bound and
# utilization with 4 holder processes + 1 central caller while a holder and the leader are
# killed, rebalance and reclaim times; writes bench/results/shares.json (about 3 minutes).
bench-shares:
	$(GO) run ./bench/shares

clean:
	rm -rf bin

# bench-regions (issue 13): a global cluster and two regional ones in one process (real Raft,
# BoltDB, gRPC over loopback): the global bound and utilization with demand split 80/20 then
# flipped, the flip's convergence, regional p99 with and without 50–150 ms on the global
# links, the global cluster down for 60 s (QUOTAD_BENCH_REGIONS_OUTAGE_SECONDS); writes bench/results/regions.json
# (BENCH_REGIONS_SECONDS=120 by default: about 4 minutes).
BENCH_REGIONS_SECONDS ?= 120
bench-regions:
	QUOTAD_BENCH_REGIONS_OUT=$(CURDIR)/bench/results/regions.json QUOTAD_BENCH_REGIONS_SECONDS=$(BENCH_REGIONS_SECONDS) \
		$(GO) test ./region -run TestBenchRegions -count=1 -v -timeout 20m
