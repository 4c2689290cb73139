"""Stand-in for deepspeed.runtime.fp16.loss_scaler (see tests/tools/stubs/README.md)."""


class LossScalerBase:
    def __init__(self, cur_scale):
        self.cur_scale = cur_scale
        self.dynamic = False


class LossScaler(LossScalerBase):
    """Static loss scale: pickled as NEWOBJ + BUILD of its __dict__."""


class DynamicLossScaler(LossScalerBase):
    def __init__(self, init_scale=2.0**16, scale_factor=2.0, scale_window=1000,
                 min_scale=1, delayed_shift=1, consecutive_hysteresis=False):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.dynamic = True
