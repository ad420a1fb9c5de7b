# The two commands of the README:
#   make train   set up, then train train/mnist.py on real Fashion-MNIST with 2 CPU processes
#   make test    set up, then run the test suite (it launches 2-process CPU runs itself)
# Override on the command line, e.g.  make train CONFIG=accelerate_configs/4gpu.yaml EPOCHS=10
PYTHON ?= python3
CONFIG ?= accelerate_configs/cpu_2proc.yaml
DATASET ?= fashion_mnist
EPOCHS ?= 3
OUTPUT_DIR ?= runs/$(DATASET)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup train test

# apt for the offline Fashion-MNIST copy (Debian's dataset-fashion-mnist), pip for the Python packages.
setup:
	@if [ ! -d $(FASHION_DIR) ]; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo=sudo; \
	  else echo "error: $(FASHION_DIR) is missing and there is no root or sudo to run apt-get install dataset-fashion-mnist"; exit 1; fi; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq dataset-fashion-mnist; \
	fi
	$(PYTHON) -m pip install --disable-pip-version-check -q -r requirements.txt

train: setup
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/mnist.py \
	  --dataset $(DATASET) --num_train_epochs $(EPOCHS) --output_dir $(OUTPUT_DIR)

test: setup
	$(PYTHON) -m pytest
