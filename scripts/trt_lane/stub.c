/* Loader stand-in for TensorRT's runtime libraries (libnvinfer, libnvinfer_plugin, libnvonnxparser): the nine entry
   points the Python bindings link against. Every factory returns NULL, which is what the real libraries return when
   CUDA cannot initialise, so nothing runs on a GPU here and no figure can come from it. */
#include <stddef.h>
void *createInferBuilder_INTERNAL(void *logger, int version) { (void)logger; (void)version; return NULL; }
void *createInferRuntime_INTERNAL(void *logger, int version) { (void)logger; (void)version; return NULL; }
void *createInferRefitter_INTERNAL(void *engine, void *logger, int version) { (void)engine; (void)logger; (void)version; return NULL; }
void *createNvOnnxParser_INTERNAL(void *network, void *logger, int version) { (void)network; (void)logger; (void)version; return NULL; }
void *createNvOnnxParserRefitter_INTERNAL(void *refitter, void *logger, int version) { (void)refitter; (void)logger; (void)version; return NULL; }
int getNvOnnxParserVersion(void) { return 0; }
void *getPluginRegistry(void) { return NULL; }
void *getBuilderPluginRegistry(int capability) { (void)capability; return NULL; }
int initLibNvInferPlugins(void *logger, const char *ns) { (void)logger; (void)ns; return 0; }
