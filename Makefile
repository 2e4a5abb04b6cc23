# reflux: convenience targets over CMake. The build itself lives in CMakeLists.txt.
#
#   make demo    configure + build (Release) in build/ and run the quick-start example
#   make test    install missing build packages, then build and test twice (build/ and a
#                sanitizer build in build-asan/); prints "N passed, N failed"
#   make bench   build and run the benchmark (bench/rf_bench.c), if there is one
#   make clean   remove the build directories

JOBS  ?= 2
CMAKE ?= cmake

.PHONY: all demo test bench clean deps

all: demo

deps:
	scripts/setup-deps.sh

demo: deps
	$(CMAKE) -S . -B build -DCMAKE_BUILD_TYPE=Release
	$(CMAKE) --build build -j $(JOBS)
	./build/quickstart

test: deps
	JOBS=$(JOBS) scripts/run-tests.sh

bench:
	@if [ -f bench/rf_bench.c ]; then \
		$(CMAKE) -S . -B build -DCMAKE_BUILD_TYPE=Release && \
		$(CMAKE) --build build -j $(JOBS) --target rf_bench && \
		./build/rf_bench; \
	else \
		echo "no benchmark yet: bench/rf_bench.c does not exist"; \
	fi

clean:
	rm -rf build build-asan
