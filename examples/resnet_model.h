/* resnet_model.h: the small ResNet of examples/resnet.c, shared with the
 * benchmark (bench/rf_bench.c runs it at the example's default width, 16) so
 * the two cannot drift. Static functions over the public API only; include it
 * after reflux.h. */
#ifndef RF_EXAMPLES_RESNET_MODEL_H
#define RF_EXAMPLES_RESNET_MODEL_H

static rf_conv_opts resnet_conv_opts(int64_t stride, int64_t pad)
{
    return (rf_conv_opts){.stride = {stride, stride}, .pad = {pad, pad}, .no_bias = true};
}

/* conv3x3 -> BN(relu) -> conv3x3 -> BN, added to the input (or to a strided
 * 1x1 projection of it when the shape changes), then relu. */
static rf_model *resnet_basic_block(int64_t in, int64_t out, int64_t stride)
{
    rf_conv_opts first = resnet_conv_opts(stride, 1), second = resnet_conv_opts(1, 1);
    rf_model *body = rf_chain(rf_conv2d(3, 3, in, out, RF_ACT_IDENTITY, &first),
                              rf_batchnorm(out, RF_ACT_RELU),
                              rf_conv2d(3, 3, out, out, RF_ACT_IDENTITY, &second),
                              rf_batchnorm(out, RF_ACT_IDENTITY));
    rf_model *residual;
    if (stride == 1 && in == out) {
        residual = rf_skip(body, RF_COMBINE_ADD);
    } else {
        rf_conv_opts proj = resnet_conv_opts(stride, 0);
        residual = rf_parallel(RF_COMBINE_ADD, body,
                               rf_chain(rf_conv2d(1, 1, in, out, RF_ACT_IDENTITY, &proj),
                                        rf_batchnorm(out, RF_ACT_IDENTITY)));
    }
    return rf_chain(residual, rf_activation_layer(RF_ACT_RELU));
}

/* Stem, three stages at 28x28, 14x14 and 7x7 with c, 2c and 4c channels,
 * global mean pool, dense to 10 classes (1x28x28 inputs). */
static rf_model *resnet_model(int64_t c)
{
    rf_conv_opts stem = resnet_conv_opts(1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, c, RF_ACT_IDENTITY, &stem), rf_batchnorm(c, RF_ACT_RELU),
                    resnet_basic_block(c, c, 1),           /* 28x28 */
                    resnet_basic_block(c, 2 * c, 2),       /* 14x14 */
                    resnet_basic_block(2 * c, 4 * c, 2),   /* 7x7 */
                    rf_global_meanpool(), rf_flatten_layer(),
                    rf_dense(4 * c, 10, RF_ACT_IDENTITY));
}

#endif
