# cmake --install: the agent's and the analyzer's headers and static libraries, the CLI
# (and the GUI when built), and an ampdiagConfig.cmake, so that a LibTorch project does
#   find_package(ampdiag CONFIG REQUIRED)
#   target_link_libraries(train PRIVATE ampdiag::agent)
# (tests/install builds such a project against an installed tree).
include(CMakePackageConfigHelpers)

set(ampdiag_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/ampdiag")
set(ampdiag_exported ampdiag_kernels ampdiag_rundb ampdiag_analyzer ampdiag_profiler ampdiag_agent_core)
set_target_properties(ampdiag_kernels PROPERTIES EXPORT_NAME kernels)
set_target_properties(ampdiag_rundb PROPERTIES EXPORT_NAME rundb)
set_target_properties(ampdiag_analyzer PROPERTIES EXPORT_NAME analyzer)
set_target_properties(ampdiag_profiler PROPERTIES EXPORT_NAME profiler)
set_target_properties(ampdiag_agent_core PROPERTIES EXPORT_NAME agent_core)
if(AMPDIAG_HAVE_CUDA)
  # The session core runs device tensors on the CUDA engine (CUDA runtime only).
  list(APPEND ampdiag_exported ampdiag_kernels_cuda)
  set_target_properties(ampdiag_kernels_cuda PROPERTIES EXPORT_NAME kernels_cuda)
endif()
install(DIRECTORY kernels/include/ analyzer/include/ analyzer/rundb/include/ profiler/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(AMPDIAG_HAVE_TORCH)
  # The agent links the libraries of the LibTorch it was built against (torch_cpu, c10, and
  # in a CUDA build torch_cuda, c10_cuda: see AmpdiagBackends.cmake), by their paths;
  # ampdiagConfig.cmake checks they exist.
  list(APPEND ampdiag_exported ampdiag_agent ampdiag_torch)
  set_target_properties(ampdiag_agent PROPERTIES EXPORT_NAME agent)
  set_target_properties(ampdiag_torch PROPERTIES EXPORT_NAME torch)
  install(DIRECTORY agent/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
install(TARGETS ${ampdiag_exported} EXPORT ampdiagTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS ampdiag RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET ampdiag-gui)
  install(TARGETS ampdiag-gui RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT ampdiagTargets NAMESPACE ampdiag:: DESTINATION ${ampdiag_cmake_dir})

set(AMPDIAG_CONFIG_TORCH_LIBS "")
if(AMPDIAG_HAVE_TORCH)
  set(AMPDIAG_CONFIG_TORCH_LIBS "${AMPDIAG_TORCH_LIBS}")
endif()
configure_package_config_file(cmake/ampdiagConfig.cmake.in "${CMAKE_CURRENT_BINARY_DIR}/ampdiagConfig.cmake"
                              INSTALL_DESTINATION ${ampdiag_cmake_dir})
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/ampdiagConfigVersion.cmake" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/ampdiagConfig.cmake" "${CMAKE_CURRENT_BINARY_DIR}/ampdiagConfigVersion.cmake"
        DESTINATION ${ampdiag_cmake_dir})
