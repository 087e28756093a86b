-- Argo CD health check for loraplex.dev/LoRAExperiment (argocd-cm key
-- resource.customizations.health.loraplex.dev_LoRAExperiment; docs/design/chart.md).
-- Reads what the operator writes (status.py): the phase, observedGeneration and the
-- kstatus conditions Ready, Reconciling and Stalled.
local hs = {status = "Progressing", message = "Waiting for the operator"}
if obj.status == nil or obj.status.phase == nil then
  return hs
end
local s = obj.status
local generation = obj.metadata.generation
if generation ~= nil and s.observedGeneration ~= nil and s.observedGeneration < generation then
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end
local conditions = {}
if s.conditions ~= nil then
  for _, c in ipairs(s.conditions) do
    conditions[c.type] = c
  end
end
local function text(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end
hs.message = s.message or s.phase
if s.phase == "Succeeded" or s.phase == "Running" then
  hs.status = "Healthy"
elseif s.phase == "Failed" then
  hs.status = "Degraded"
elseif s.phase == "Suspended" then
  hs.status = "Suspended"
elseif conditions.Stalled ~= nil and conditions.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = text(conditions.Stalled)
elseif conditions.Scheduled ~= nil and conditions.Scheduled.status == "False" then
  hs.message = text(conditions.Scheduled)
end
return hs
