"""`ElasticSettings`: what an elastic job is started with (horovodrun's and
horovod.ray's `ElasticRayExecutor.create_settings`'s fields)."""


class ElasticSettings:
    def __init__(
        self,
        discovery=None,
        min_num_proc=None,
        max_num_proc=None,
        elastic_timeout=None,
        reset_limit=None,
        cooldown_range=None,
        num_proc=None,
        verbose=0,
        ssh_port=None,
        ssh_identity_file=None,
        nics=None,
        start_timeout=None,
        timeout_s=30,
        output_filename=None,
        placement_group_timeout_s=100,
        **others,
    ):
        self.discovery = discovery
        self.min_num_proc, self.max_num_proc = min_num_proc, max_num_proc
        self.elastic_timeout, self.reset_limit, self.cooldown_range = elastic_timeout, reset_limit, cooldown_range
        self.num_proc, self.verbose = num_proc, verbose
        self.ssh_port, self.ssh_identity_file, self.nics = ssh_port, ssh_identity_file, nics
        self.start_timeout = start_timeout if start_timeout is not None else timeout_s
        self.timeout_s = timeout_s
        self.placement_group_timeout_s = placement_group_timeout_s
        self.output_filename = output_filename
        self.elastic = True
        for name, value in others.items():
            setattr(self, name, value)

    # the discovery object is the caller's: it does not travel
    def __getstate__(self):
        state = dict(self.__dict__)
        state["discovery"] = None
        return state
