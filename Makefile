# reflux: convenience targets over CMake. The build itself lives in CMakeLists.txt.
#
#   make demo    install missing packages, configure + build (Release) in build/, then train
#                the Fashion-MNIST classifier for 3 epochs (learning curve in build/)
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
	./build/fashion_mnist --epochs 3 --csv build/fashion_mnist.csv --svg build/fashion_mnist.svg

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
