# reflux: convenience targets over CMake. The build itself lives in CMakeLists.txt.
#
#   make demo    install missing packages, configure + build (Release) in build/, then train
#                the Fashion-MNIST CNN for 5 epochs (learning curve in build/)
#   make test    install missing build packages, then build and test twice (build/ and a
#                sanitizer build in build-asan/); prints "N passed, N failed"
#   make bench   build and run build/rf_bench, then the side-by-side comparison with PyTorch
#                and JAX (bench/compare.sh; peers skipped when not installed)
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
	./build/fashion_mnist --model cnn --epochs 5 --batch 64 --csv build/fashion_mnist.csv --svg build/fashion_mnist.svg

test: deps
	JOBS=$(JOBS) scripts/run-tests.sh

bench: deps
	$(CMAKE) -S . -B build -DCMAKE_BUILD_TYPE=Release
	$(CMAKE) --build build -j $(JOBS) --target rf_bench
	./build/rf_bench
	bench/compare.sh --bench build/rf_bench

clean:
	rm -rf build build-asan build-fuzz
