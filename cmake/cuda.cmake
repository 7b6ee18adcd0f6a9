# CUDA part of the extension: the FFI handlers plus one kernel instantiation per file
# (they compile in parallel, and JAXFLASH_HEAD_DIMS skips the ones not wanted).
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_ARCHITECTURES ${JAXFLASH_CUDA_ARCHS})

set(_cuda_sources csrc/ffi_cuda.cu)
foreach(hdim ${JAXFLASH_HEAD_DIMS})
  file(GLOB _inst "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/instantiations/*_hdim${hdim}_*.cu")
  if(NOT _inst)
    message(FATAL_ERROR "jaxflash: no CUDA kernels for head dim ${hdim}")
  endif()
  list(APPEND _cuda_sources ${_inst})
endforeach()

target_sources(_jaxflash_ext PRIVATE ${_cuda_sources})
# The build-info strings keep the lists' ";", which COMPILE_DEFINITIONS would split into
# separate definitions even when escaped, so module.cc gets them from a generated header.
file(CONFIGURE OUTPUT "${CMAKE_CURRENT_BINARY_DIR}/jaxflash_build_info.h" CONTENT
  "#define JAXFLASH_CUDA_ARCHS \"@JAXFLASH_CUDA_ARCHS@\"\n#define JAXFLASH_HEAD_DIMS \"@JAXFLASH_HEAD_DIMS@\"\n")
set_source_files_properties(csrc/module.cc PROPERTIES
  COMPILE_OPTIONS "-include;${CMAKE_CURRENT_BINARY_DIR}/jaxflash_build_info.h")
target_compile_definitions(_jaxflash_ext PRIVATE JAXFLASH_WITH_CUDA)
foreach(hdim ${JAXFLASH_HEAD_DIMS})
  target_compile_definitions(_jaxflash_ext PRIVATE JAXFLASH_HDIM${hdim})
endforeach()
# The sm90 forward (wgmma, setmaxnreg) needs the arch-specific sm_90a target.
if("90a" IN_LIST JAXFLASH_CUDA_ARCHS)
  target_compile_definitions(_jaxflash_ext PRIVATE JAXFLASH_SM90)
endif()
target_compile_options(_jaxflash_ext PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo --use_fast_math>)
target_link_libraries(_jaxflash_ext PRIVATE CUDA::cudart_static)
# The target exists before enable_language(CUDA), so it never saw CMAKE_CUDA_ARCHITECTURES.
set_target_properties(_jaxflash_ext PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
  CUDA_ARCHITECTURES "${JAXFLASH_CUDA_ARCHS}")
