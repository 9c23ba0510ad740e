/* Loader stand-in for TensorRT's runtime libraries (libnvinfer, libnvinfer_plugin, libnvonnxparser), used only by the
 * CPU test lane (tests/trt_lane.py). It exports the nine C entry points NVIDIA's `tensorrt` Python bindings link
 * against, and every factory returns NULL -- what the real library returns when CUDA cannot initialise. Nothing here
 * runs on a GPU, builds or runs an engine, or produces any figure: it only lets `import tensorrt` load the real
 * bindings and `tensorrt.plugin` on a machine that has neither a GPU nor the runtime libraries. */
#include <stddef.h>

void *createInferBuilder_INTERNAL(void *logger, int version) { (void)logger; (void)version; return NULL; }
void *createInferRuntime_INTERNAL(void *logger, int version) { (void)logger; (void)version; return NULL; }
void *createInferRefitter_INTERNAL(void *engine, void *logger, int version)
{ (void)engine; (void)logger; (void)version; return NULL; }
void *createNvOnnxParser_INTERNAL(void *network, void *logger, int version)
{ (void)network; (void)logger; (void)version; return NULL; }
void *createNvOnnxParserRefitter_INTERNAL(void *refitter, void *logger, int version)
{ (void)refitter; (void)logger; (void)version; return NULL; }
int getNvOnnxParserVersion(void) { return 0; }
void *getPluginRegistry(void) { return NULL; }
void *getBuilderPluginRegistry(int capability) { (void)capability; return NULL; }
int initLibNvInferPlugins(void *logger, const char *plugin_namespace) { (void)logger; (void)plugin_namespace; return 0; }
