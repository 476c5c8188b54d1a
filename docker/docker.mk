# Docker targets, included by the Makefile. Variables can be set on the command line:
#   make docker-run DOCKER_RUN_ARGS='-v /data/cifar10:/app/data/cifar10:ro' DOCKER_CMD='torchrun -m distlib.runner recipes/cifar.yaml'
DOCKER ?= docker
DOCKER_IMAGE ?= distlib
DOCKER_BUILD_ARGS ?=
DOCKER_RUN_ARGS ?=
DOCKER_CMD ?=

.PHONY: docker-build docker-run docker-test

docker-build:  ## build the GPU image (docker/Dockerfile) as $(DOCKER_IMAGE)
	$(DOCKER) build -f docker/Dockerfile -t $(DOCKER_IMAGE) $(DOCKER_BUILD_ARGS) .

docker-run:  ## train the default recipe in the image on all GPUs; runs land in ./runs
	mkdir -p runs
	$(DOCKER) run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
		--user "$$(id -u):$$(id -g)" -v distlib-cache:/cache \
		-v "$(CURDIR)/data:/app/data:ro" -v "$(CURDIR)/runs:/app/runs" \
		$(DOCKER_RUN_ARGS) $(DOCKER_IMAGE) $(DOCKER_CMD)

docker-test:  ## build the image with buildah on a local Debian stand-in base and train the demo in it (no Docker engine needed; root)
	bash docker/test.sh

.PHONY: docker-test-clean
docker-test-clean:  ## remove what docker-test left: its images (several GB) and scratch folder
	-buildah rmi -f localhost/distlib:test localhost/distlib-standin:bookworm
	rm -rf $${DOCKER_TEST_WORK:-/var/tmp/distlib-docker-test}
